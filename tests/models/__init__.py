"""The model zoo: small models written the way popular libraries write theirs, each with the
kind of state real models have and the project's own test models lack (tests/e2e/test_zoo.py runs
every parallel mode over them).

- :mod:`.llama`: a Llama-style decoder as torchtitan writes it: RMSNorm, SwiGLU, grouped-query
  attention, a complex64 RoPE cache as a non-persistent buffer, and a fused ``wqkv`` that its
  ``state_dict`` hooks present as ``wq``/``wk``/``wv`` (interleaved by KV head, copies that share
  no storage with the parameter), gathering a DTensor first (a collective, as torchtitan's does);
  its tensor-parallel and pipeline tasks, and ``LlamaCountingTask``, whose blocks write int64 and
  bool buffers in place under ``parallel=tp`` and ``parallel=pp``.
- :mod:`.gpt`: a GPT-2-style LM as Hugging Face writes it: the output head tied to the token
  embedding (two keys, one tensor, not the largest), dropout, a bool causal mask as a
  non-persistent buffer.
- :mod:`.cnn`: a BatchNorm CNN with a residual block (running statistics, an int64 counter).
- :mod:`.counters`: integer and bool buffers that the forward changes (persistent).

Each module holds the model and its Task (synthetic data from the generator it is given), so a
job runs it with ``~task +task._target_=models.<module>.<Task>`` and PYTHONPATH on ``tests/``.
"""
