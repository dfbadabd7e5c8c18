"""docs/benchmarks.md against bench/results/*.json: ``python -m bench --check`` and ``--render-docs``.

Two conventions, both invisible in the rendered page:

- a **figure** quoted in prose carries a marker right after it naming its JSON file and key:
  ``+1.0 %<!--@ only-b3.json:b3.overhead_pct -->``. The file may be left out after a
  ``<!-- bench:source only-b3.json -->`` line (it holds until the next one). The figure is the
  last number before the marker on its line; it must equal the JSON value rounded to the digits
  written. A key is a dotted path: names, list indices, ``[field=value]`` picks the list item
  whose field has that value; a suffix ``|min``, ``|max``, ``|median``, ``|len`` reduces a list;
  a factor ``x100`` or ``x1000`` scales it (a fraction quoted in %, seconds quoted in ms), ``/1e6``
  divides (bytes quoted in MB).
- a **table** is rendered from its JSON: ``<!-- bench:table NAME FILE -->`` .. ``<!-- /bench:table -->``;
  ``--render-docs`` rewrites what is between the two lines, ``--check`` compares it.

``--check`` reads every page that can quote a measurement (``README.md`` and ``docs/*.md``: a page
with no marker has nothing to check), lists every figure that its JSON does not hold (with its page
and line) and every table that is not what its JSON renders, and exits 1 if there is one. It also
says how many package commits ``HEAD`` has past the core that ``latest.json`` measured
(``git rev-list --count <core>..HEAD -- ckptless_hpc``), computed when it runs.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import report

FIGURE = re.compile(r"<!--@\s*(?:(?P<file>[\w.-]+\.json):)?(?P<key>\S+?)(?:\s+(?P<scale>[x/][0-9.e+-]+))?\s*-->")
SOURCE = re.compile(r"<!--\s*bench:source\s+(?P<file>[\w.-]+\.json)\s*-->")
TABLE = re.compile(r"<!--\s*bench:table\s+(?P<name>\w+)\s+(?P<file>[\w.-]+\.json)\s*-->")
TABLE_END = re.compile(r"<!--\s*/bench:table\s*-->")
NUMBER = re.compile(r"(?:(?<![\w.)])[-+\u2212])?\d[\d,]*(?:\.\d+)?")  # a dash after a digit is a range (0.45-1.66), not a sign
_PICK = re.compile(r"\[(?P<field>\w+)=(?P<value>[^\]]+)\]")
_REDUCE: Dict[str, Callable[[List[float]], float]] = {"min": min, "max": max, "median": statistics.median, "len": len}


class KeyMissing(LookupError):
    pass


def lookup(doc: Any, key: str) -> Any:
    """The value at a dotted ``key`` of a JSON document (see the module's docstring)."""
    path, _, reduce = key.partition("|")
    x = doc
    for part in path.split("."):
        name = part.split("[", 1)[0]
        if name:
            if isinstance(x, list) and name.isdigit() and int(name) < len(x):
                x = x[int(name)]
            elif isinstance(x, dict) and name in x:
                x = x[name]
            else:
                raise KeyMissing(f"no {name!r} in {key}")
        picks = _PICK.findall(part[len(name):])
        if picks:  # [field=value]...: the one list item whose fields have these values
            hits = [v for v in (x if isinstance(x, list) else []) if isinstance(v, dict) and all(str(v.get(f)) == val for f, val in picks)]
            if len(hits) != 1:
                raise KeyMissing(f"{len(hits)} items with {', '.join(f'{f}={v}' for f, v in picks)} in {key}")
            x = hits[0]
    if reduce:
        if reduce not in _REDUCE or not isinstance(x, list):
            raise KeyMissing(f"|{reduce} needs a list and one of {', '.join(_REDUCE)} ({key})")
        x = _REDUCE[reduce]([float(v) for v in x])
    return x


def _scaled(value: float, scale: Optional[str]) -> float:
    if not scale:
        return value
    f = float(scale[1:])
    return value * f if scale[0] == "x" else value / f


def quoted(text: str, start: int = 0) -> Optional[Tuple[float, int]]:
    """The last number of ``text`` and its decimals ("1,790" -> (1790, 0); "-6.8" -> (-6.8, 1));
    None when it begins before ``start`` (the text before it only tells a dash from a sign)."""
    nums = list(NUMBER.finditer(text))
    if not nums or nums[-1].start() < start:
        return None
    s = nums[-1][0].replace(",", "").replace("\u2212", "-")
    return float(s), len(s.split(".")[1]) if "." in s else 0


def matches(q: float, digits: int, value: float) -> bool:
    """``q``, written with ``digits`` decimals, is ``value`` rounded (half a unit of the last digit)."""
    return abs(abs(value) - abs(q)) <= 0.5 * 10.0 ** -digits * (1 + 1e-9) + 1e-12 and (q == 0 or value == 0 or (q > 0) == (value > 0))


# ---------------------------------------------------------------- the tables
def _md(head: List[str], body: List[List[str]]) -> List[str]:
    return ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"] + ["| " + " | ".join(r) + " |" for r in body]


def b6_sim_table(res: Dict[str, Any]) -> List[str]:
    s = res["b6_sim"]
    over = 100.0 * s["costs"]["steady_overhead"]
    body = []
    for p in s["points"]:
        mtbf = p["mtbf_s"] / 3600
        body.append([
            f"{p['gpus']:,}", f"{mtbf:.1f} h" if mtbf >= 1 else f"{60 * mtbf:.0f} min", f"{p['checkpointless_downtime_s']:.2f} s",
            f"{100 * p['checkpointless_goodput']:.2f}%", f"{100 * p['checkpointless_throughput']:.2f}%", f"{p['restart_s']:.1f} s",
            f"{p['interval_s']:.0f} s", f"{100 * p['ckpt_restart_goodput']:.2f}%",
        ])
    head = ["GPUs", "MTBF", "ckptless D", "ckptless goodput", f"x (1 - {over:.2f}%)", "restart R", "optimal interval", "ckpt-restart goodput"]
    return _md(head, body)


def b8_overhead_table(res: Dict[str, Any]) -> List[str]:
    body = []
    for r in res["b8"]["overhead"]:
        pairs = r.get("pair_ratios")
        spread = f"{min(pairs):.3f}-{max(pairs):.3f}" if pairs else "-"
        body.append([
            r["mode"], f"{r['params'] / 1e6:.1f} M", str(r["nodes"]), str(r["factor"]), f"{r['step_s_no_copies']:.3f} s", f"{r['step_s_copies']:.3f} s",
            f"{r['overhead_pct']:+.1f} %" + ("" if pairs else " (pooled)"), spread, r.get("verdict") or ("n/a" if r["factor"] == 1 else "-"),
            f"{r['copies_mb_per_rank']:.0f}" if r.get("copies_mb_per_rank") else "-",
        ])
    head = ["mode", "params", "nodes", "factor", "step, no copies", "step, copies", "overhead (median of pairs)", "pair ratios", "<= 3 % at factor 1", "host MB per rank"]
    return _md(head, body)


def b8_recover_table(res: Dict[str, Any]) -> List[str]:
    body = []
    for r in res["b8"]["recover"]:
        oracle = r.get("oracle")
        body.append([r["mode"], f"{r['params'] / 1e6:.1f} M", f"{r['shard_mb']:.0f} MB", f"{r['transfer_s']:.3f} s", f"{r['downtime_s']:.2f} s",
                     "not compared (no fault-free run)" if oracle is None else ("bitwise equal" if oracle else "DIFFERENT")])
    return _md(["mode", "params", "shard", "transfer", "downtime", "final state vs the fault-free run"], body)


def b5_table(res: Dict[str, Any]) -> List[str]:
    """B5 (bench/b5.py): per world size and control, the coordinator's work and a survivor's, side by side."""
    body = [[
        f"{r['ranks']:,}", str(r["nodes"]), r["control"], f"{r['coordinator_cpu_ms']:.0f} ms", f"{r['coordinator_cpu_us_per_rank']:.0f} µs",
        f"{r['assign_ms']:.0f} ms", f"{r['reformed_ms']:.0f} ms", f"{r['survivor_messages']:.0f}", f"{r['survivor_bytes']:,.0f}", str(r["reps"]),
    ] for r in res["b5"]["rows"]]
    head = ["ranks", "nodes", "control", "coordinator CPU in the recovery", "per rank", "closed → last `assign`", "→ re-formed",
            "a survivor's messages", "their bytes", "runs"]
    return _md(head, body)


def b7_table(res: Dict[str, Any]) -> List[str]:
    body = [[f"{p['ranks']:,}", p.get("control", "rank"), f"{p['cpu_pct']:.1f} %", f"{p['hb_delay_p99_ms']:.0f} ms", f"{p['abort_ms']:.0f} ms",
             f"{p['assign_ms']:.0f} ms", f"{p['reformed_ms']:.0f} ms", f"{p['startup_s']:.1f} s ({p['startup_lost']})", str(p["false_failures"]),
             f"{p['recovery_cpu_ms'] / 1e3:.2f} s"] for p in res["b7"]["points"]]
    head = ["ranks", "control", "coordinator CPU", "heartbeat delay p99", "closed → last abort", "closed → last `assign`", "→ re-formed",
            "start-up (lost)", "false failures", "coordinator CPU in the recovery"]
    return _md(head, body)


def b9_shrink_table(res: Dict[str, Any]) -> List[str]:
    body = []
    for p in res["b9"]["shrink"]:
        cpu = p.get("cpu_ratio")
        body.append([
            f"{p['nodes']} -> {p['live_after']}", f"{p['step_s_before']:.3f} s", f"{p['step_s_after']:.3f} s", f"x{p['slowdown']:.2f}",
            f"x{p['ideal_slowdown']:.2f}", f"{p['vs_ideal_pct']:+.1f} %", f"x{p['bound_slowdown']}", f"{p['vs_bound_pct']:+.1f} %",
            "n/a" if cpu is None else f"x{cpu:.2f}", f"{p['shrink']['downtime_s']:.3f} s", str(p["reps"]), "bitwise equal" if p["shrink"]["oracle"] else "DIFFERENT",
        ])
    head = ["nodes -> processes", "step before", "step after", "slowdown", "ideal (V / live)", "vs ideal", "busiest share", "vs busiest share",
            "workers' CPU/step after / before", "shrink downtime", "runs", "final state vs the fault-free run"]
    return _md(head, body)


TABLES: Dict[str, Callable[[Dict[str, Any]], List[str]]] = {
    "b9_shrink": b9_shrink_table,
    "b7": b7_table,
    "b5": b5_table,
    "main": lambda res: report.markdown(res).splitlines(),
    "b6_sim": b6_sim_table,
    "b8_overhead": b8_overhead_table,
    "b8_recover": b8_recover_table,
}


# ---------------------------------------------------------------- the check
@dataclass
class Problem:
    line: int
    what: str
    page: str = "docs/benchmarks.md"

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.what}"


class Results:
    """bench/results/*.json, each read once."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._cache: Dict[str, Any] = {}

    def get(self, name: str) -> Any:
        if name not in self._cache:
            path = self.folder / name
            if not path.is_file():
                raise KeyMissing(f"{path} does not exist")
            try:
                self._cache[name] = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise KeyMissing(f"{path} is not JSON ({e})") from None
        return self._cache[name]


def _figure_problem(line: str, since: int, m: "re.Match[str]", source: Optional[str], results: Results) -> Optional[str]:
    """What is wrong with the figure that marker ``m`` closes (the last number between the
    previous marker, which ends at ``since``, and ``m``), or None."""
    name = m["file"] or source
    if name is None:
        return f"figure marker {m[0]!r} names no JSON file and no <!-- bench:source FILE.json --> line is above it"
    earlier = re.sub(r"<!--.*?-->", "", line[:since])
    before = earlier + line[since:m.start()]
    q = quoted(before, len(earlier))
    if q is None:
        return f"no number before {m[0]!r}"
    try:
        value = lookup(results.get(name), m["key"])
    except KeyMissing as e:
        return f"{q[0]:g} quotes {name}:{m['key']}, which is not there ({e})"
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return f"{q[0]:g} quotes {name}:{m['key']}, which is {value!r}, not a number"
    v = _scaled(float(value), m["scale"])
    if not matches(q[0], q[1], v):
        return f"{before.strip()[-40:]!r} quotes {q[0]:g}, but {name}:{m['key']}{' ' + m['scale'] if m['scale'] else ''} is {v:.6g}"
    return None


def check(doc: str, results: Results) -> Tuple[List[Problem], int]:
    """Every figure and table of ``doc`` that its JSON does not hold, and how many were checked."""
    problems: List[Problem] = []
    checked = 0
    source: Optional[str] = None
    lines = doc.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        s = SOURCE.search(line)
        if s:
            source = s["file"]
        t = TABLE.search(line)
        if t:
            end = next((j for j in range(i + 1, len(lines)) if TABLE_END.search(lines[j])), None)
            if end is None:
                problems.append(Problem(i + 1, f"table {t['name']} has no <!-- /bench:table --> line"))
                break
            checked += 1
            want = render_table(t["name"], t["file"], results)
            if isinstance(want, str):
                problems.append(Problem(i + 1, want))
            else:
                have = lines[i + 1:end]
                for k, (a, b) in enumerate(zip(have + [""] * len(want), want + [""] * len(have))):
                    if a != b:
                        problems.append(Problem(i + 2 + k, f"table {t['name']} is not what {t['file']} renders: the line should read {b!r} (python -m bench --render-docs)"))
                        break
            i = end + 1
            continue
        pos = 0
        for m in FIGURE.finditer(line):
            checked += 1
            why = _figure_problem(line, pos, m, source, results)
            if why:
                problems.append(Problem(i + 1, why))
            pos = m.end()
        i += 1
    return problems, checked


def render_table(name: str, file: str, results: Results) -> Any:
    if name not in TABLES:
        return f"unknown table {name!r}: one of {', '.join(TABLES)}"
    try:
        return TABLES[name](results.get(file))
    except (KeyMissing, KeyError, TypeError, ValueError) as e:
        return f"table {name} cannot be rendered from {file}: {type(e).__name__}: {e}"


def render(doc: str, results: Results) -> str:
    """``doc`` with every table block rewritten from its JSON (figures in prose are left alone)."""
    out: List[str] = []
    lines = doc.splitlines()
    i = 0
    while i < len(lines):
        out.append(lines[i])
        t = TABLE.search(lines[i])
        end = next((j for j in range(i + 1, len(lines)) if TABLE_END.search(lines[j])), None) if t else None
        if t and end is not None:
            want = render_table(t["name"], t["file"], results)
            if isinstance(want, str):
                raise ValueError(f"docs/benchmarks.md:{i + 1}: {want}")
            out += want
            i = end
            continue
        i += 1
    return "\n".join(out) + ("\n" if doc.endswith("\n") else "")


def pages(repo: Path) -> List[Path]:
    """Every page that can quote a measurement: the README and each page of docs/."""
    return [p for p in [repo / "README.md", *sorted((repo / "docs").glob("*.md"))] if p.is_file()]


def commits_behind(results_dir: Path, repo: Path) -> Tuple[Optional[int], str]:
    """How many commits touching ``ckptless_hpc/`` ``HEAD`` has past the core that
    ``latest.json`` measured (``machine.core_commit``), and a line that says so (or why not)."""
    try:
        core = (json.loads((results_dir / "latest.json").read_text(encoding="utf-8")).get("machine") or {}).get("core_commit")
    except (OSError, json.JSONDecodeError) as e:
        return None, f"latest.json's core: not read ({e})"
    if not core:
        return None, "latest.json names no core commit (machine.core_commit): how far behind HEAD it is cannot be told"
    cmd = ["git", "-C", str(repo), "rev-list", "--count", f"{core}..HEAD", "--", "ckptless_hpc"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"latest.json's core {core[:7]}: git could not count the commits after it ({e})"
    if p.returncode != 0 or not p.stdout.strip().isdigit():
        return None, f"latest.json's core {core[:7]}: git could not count the commits after it ({p.stderr.strip()[:200] or 'no output'}); not a checkout holding that commit?"
    n = int(p.stdout.strip())
    return n, f"latest.json measured core {core[:7]}: HEAD is {n} package commit(s) past it (git rev-list --count {core[:7]}..HEAD -- ckptless_hpc)"


def _shown(path: Path, repo: Optional[Path]) -> str:
    try:
        return str(path.resolve().relative_to(repo.resolve())) if repo is not None else str(path)
    except ValueError:
        return str(path)


def main_check(doc_paths: Any, results_dir: Path, repo: Optional[Path] = None) -> int:
    """``--check``: every page of ``doc_paths`` (one path or several) against ``results_dir``.
    A page given alone must hold something to check; of several, a page without a marker is
    left out (it quotes no kept measurement), but not all of them."""
    paths = [doc_paths] if isinstance(doc_paths, Path) else list(doc_paths)
    problems: List[Problem] = []
    counts: Dict[str, int] = {}
    for path in paths:
        name = str(path) if len(paths) == 1 or repo is None else _shown(path, repo)
        found, checked = check(path.read_text(encoding="utf-8"), Results(results_dir))
        problems += [Problem(p.line, p.what, name) for p in found]
        if checked:
            counts[name] = checked
    if not counts:
        problems.append(Problem(1, "no figure marker and no table block: nothing could be checked", str(paths[0]) if len(paths) == 1 else "README.md and docs/*.md"))
    for p in problems:
        print(str(p))
    if repo is not None:
        print(f"python -m bench --check: {commits_behind(results_dir, repo)[1]}")
    where = ", ".join(f"{k} ({n})" for k, n in counts.items())
    if problems:
        print(f"python -m bench --check: {len(problems)} figure(s) not in the JSON they name (pages checked: {where or 'none'}). "
              f"HINT: quote the JSON's value (or fix the marker's key); tables: python -m bench --render-docs")
        return 1
    total = sum(counts.values())
    print(f"python -m bench --check: all {total} marked figures and tables of {len(counts)} page(s) are in their JSON ({results_dir}): {where}")
    return 0


def main_render(doc_paths: Any, results_dir: Path, repo: Optional[Path] = None) -> int:
    paths = [doc_paths] if isinstance(doc_paths, Path) else list(doc_paths)
    for doc_path in paths:
        text = doc_path.read_text(encoding="utf-8")
        new = render(text, Results(results_dir))
        if new != text:
            doc_path.write_text(new, encoding="utf-8")
            print(f"python -m bench --render-docs: rewrote the tables of {doc_path} from {results_dir}")
    return main_check(paths, results_dir, repo)
