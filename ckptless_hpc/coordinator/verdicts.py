"""How a job ends, in words and exit codes: pure functions of what happened (no I/O). The shell
and the saver (saving.py) carry the endings out; what they say is decided here."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_NO_SPARE = 3
EXIT_STARTUP = 4
EXIT_REQUEUED = 5
EXIT_CANCELLED = 6
EXIT_NONFINITE = 7


def startup_timeout(missing: List[str], timeout_s: float) -> str:
    named = f"{missing}" if len(missing) <= 20 else f"{missing[:20]} and {len(missing) - 20} more"
    return f"workers {named} did not start within cluster.startup_timeout_s={timeout_s}s"


def save_holder(survivors: Mapping[int, str], held: Mapping[str, Optional[int]]) -> Optional[Tuple[int, str]]:
    """The newest committed step a survivor holds and the lowest rank holding it; None when no
    survivor holds the job's state (a spare that never received it reports no step)."""
    steps = {w: s for w, s in held.items() if s is not None}
    if not steps:
        return None
    target = max(steps.values())
    return target, next(w for r, w in sorted(survivors.items()) if steps.get(w) == target)


def final_writers(done: Any, rank_of: Mapping[str, int], shard_of: Mapping[int, int], adopted: Optional[Mapping[str, Iterable[int]]] = None) -> Dict[int, str]:
    """train.save_final: each shard written by the lowest rank holding it (``adopted``: the lost
    ranks' shards a worker steps in a job that shrank under ZeRO, which it holds alone)."""
    writers: Dict[int, str] = {}
    for w in sorted(done, key=lambda w: rank_of[w]):
        writers.setdefault(shard_of.get(rank_of[w], 0), w)
        for shard in (adopted or {}).get(w, ()):
            writers.setdefault(shard, w)
    return writers


def where_saved(saved: Optional[Dict[str, Any]], resume: Optional[Dict[str, Any]], save_error: Optional[str]) -> str:
    """What the emergency copy holds, said plainly: written, a newer one kept, or nothing."""
    if saved and saved.get("written", True):
        return f"State of step {saved['step']} saved to {saved['path']}. "
    if saved:
        return f"A verified copy of step {saved['step']} was already at {saved['path']} and is kept (no survivor held a newer step). "
    previous = f" The copy of step {resume['step']} this job resumed from stays at {resume['path']}." if resume else ""
    return f"No state could be saved: {save_error or 'nothing trained survived'}.{previous} "


def state_lost_where(resume: Optional[Dict[str, Any]]) -> str:
    last = f"the last copy written is the one of step {resume['step']} ({resume['path']})" if resume else "no copy was ever written"
    return f"No newer state survives: {last}. "


def not_requeued(reason: str, where: str, requeue_why: str, state_lost: bool) -> Tuple[str, str]:
    """The status and message of a job that cannot go on and was not requeued."""
    msg = f"cannot continue: {reason}. {where}Not requeued: {requeue_why}. "
    if state_lost:
        msg += "HINT: raise replication.factor (more copies of each shard, on other nodes), or use parallel=hsdp with more replicas"
    else:
        msg += "HINT: raise cluster.spare_nodes (or cluster.max_refills) so that a spare is left for every failure you expect"
    return ("state_lost" if state_lost else "no_spare"), msg


def nonfinite(nf: Dict[str, Any], saved: Optional[Dict[str, Any]], where_if_not: str, t: Any) -> str:
    """train.on_nonfinite: which step and rank saw what, where the last finite state is, what to do."""
    what = f"loss {nf.get('loss')}" if str(nf.get("loss")) in ("nan", "inf", "-inf") else f"gradient norm {nf.get('grad_norm')}"
    if saved and saved.get("written", True):
        where = f"the last finite state, after {saved['step']} committed steps, is saved to {saved['path']}"
    else:
        where = where_if_not.rstrip(". ")
    if nf.get("skipped") is None:
        why, hint = "train.on_nonfinite=stop", "set train.on_nonfinite=skip to drop such steps"
    else:
        why = f"train.on_nonfinite=skip has dropped {nf['skipped']} of train.steps={t.steps} steps already, the most train.max_skipped_fraction={t.max_skipped_fraction} allows"
        hint = "raise train.max_skipped_fraction (1.0: no limit) only if dropping that many steps is what you want"
    return (
        f"step {nf.get('step')} (0-based): {what} is not finite (rank {nf.get('rank')} on node {nf.get('node')}, {why}); "
        f"{where}. HINT: lower optim.lr, set train.clip_grad_norm, or {hint}"
    )


def final_save_failed(sha: str, error: str, run_dir: str) -> str:
    """The error of a final save, with the hint of its own cause: a write failure carries its
    own (a full disk, a read-only filesystem); an exporter that never answered is waiting on
    something (the model's own code); anything else is named as it is."""
    done = f"training completed (state sha256 {sha}), but {error}"
    if "HINT:" in error:
        return f"{done}; train.save_final=false skips the final save"
    if "did not write" in error:
        return (
            f"{done}. HINT: the exporting rank's log (ckptless-hpc logs {run_dir}) shows where it waits: the model is presented by a fresh "
            "build_model() and its state_dict() hooks (docs/tasks.md, two views of the model's state); train.save_final=false skips the final save"
        )
    return f"{done}. HINT: the cause is named above; train.save_final=false skips the final save"
