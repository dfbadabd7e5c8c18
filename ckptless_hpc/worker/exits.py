"""The worker's exit codes (the coordinator and the launchers read them; never renumber)."""

EXIT_COORDINATOR_LOST = 17
EXIT_STARTUP_ERROR = 18
EXIT_CUDA_POISONED = 19  # a CUDA error poisoned the context: replaced through the spare path
EXIT_WEDGED = 20  # an NCCL abort or a CUDA stream check did not return within cluster.abort_timeout_s
EXIT_WORKER_FAILED = 21  # its own error while training (worker_failed sent first): the job's error, not a loss to recover
