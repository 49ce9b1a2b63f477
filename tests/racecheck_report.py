"""Sorts a compute-sanitizer racecheck report of the GPU tiers by what each hazard is:

    NV_COMPUTE_SANITIZER_MAX_RACECHECK_HAZARDS=100000000 compute-sanitizer --tool racecheck \
        --print-limit 100000 python tests/sanitize_run.py > race.log 2>&1
    python tests/racecheck_report.py race.log

- "hand-off": both accesses are on a line of csrc/ that names one of HANDOFFS' shared-memory hand-offs:
  racecheck (CUDA 13.0, H100) reports these although named barriers order them (a bar.arrive's
  earlier accesses are visible to the threads that bar.sync on the same barrier; a bar.sync after such
  hand-offs orders its exchange too); tests/racecheck_named_barriers.cu reproduces the reports on a
  kernel whose synchronization is correct;
- "third-party": in a kernel of another library (cuBLAS's nvjet GEMMs that torch launches);
- "unexplained": anything else, printed in full.
The exit status is 1 if a hazard is unexplained or the report is incomplete: racecheck stops recording
at its hazard limit ("Maximum number of hazards reached": with the default, the run above hit it in
sparse_attn's paths on the H100; at 10^8 it reported 516, 454 hand-offs and 62 nvjet), and prints no
more than --print-limit. csrc/ is built with -lineinfo (dsv4ops/csrc.py), so each access names its file
and line."""

import dataclasses
import functools
import pathlib
import re
import sys

CSRC = pathlib.Path(__file__).resolve().parents[1] / "csrc"

# Source text of an access -> the barrier that orders it. Matched against the reported line, so a
# hand-off keeps its entry when lines move; a new hand-off is unexplained until it is named here.
HANDOFFS = {
    # sparse_attn.cu, warpgroup 0 -> 1 per tile: P and the rescale factors (kHandoffFull, reuse after
    # kHandoffEmpty), then the sums and the output tile after the consumers' bar.sync (kConsumerBar)
    "sm.handoff[b]": "kHandoffFull / kHandoffEmpty",
    "sm.inv[threadIdx.x": "kConsumerBar",
    "sm.q + r * 1024": "kConsumerBar",
    # pipeline.cuh: the output tile's read, after the bar.sync on the writers' side (either kernel);
    # a tile's valid-key mask, producers -> warpgroup 0 (kFull, reuse after kEmpty)
    "tile + r * 1024": "kConsumerBar / kGroup1Bar",
    "sm.mask[buf][part]": "kFull / kEmpty",
    "sm.mask[b]": "kFull / kEmpty",
    "sm.mask[kb]": "kFull / kEmpty",
    # small_heads.cu, warpgroup 0 -> 1: a tile's rescale factors and flag (kFullP, reuse after kEmptyP),
    # the final sums (kSumsBar)
    "sm.alpha[b]": "kFullP / kEmptyP",
    "sm.moved[b]": "kFullP / kEmptyP",
    "sm.inv[h]": "kSumsBar",
    "sm.inv[head_of(": "kSumsBar",
}
THIRD_PARTY = ("nvjet",)

_TRUNCATED = "Maximum number of hazards reached"
_SUMMARY = re.compile(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?")
_ACCESS = re.compile(r"(Read|Write) access at (.+?)\+0x[0-9a-f]+(?: in (\S+?):(\d+))?(?: \[\d+ hazards\])?$")


@dataclasses.dataclass(frozen=True)
class Access:
    kind: str
    function: str
    file: str | None
    line: int | None


def parse(text: str) -> list[list[Access]]:
    """The report's hazards, each as its accesses (the first, then those it raced with)."""
    hazards = []
    for block in text.split("Error: Race reported between ")[1:]:
        accesses = []
        for raw in block.splitlines():
            m = _ACCESS.search(raw.strip())
            if m:
                accesses.append(Access(m[1], m[2], m[3], int(m[4]) if m[4] else None))
        hazards.append(accesses)
    return hazards


@functools.cache
def _source_lines(name: str, root: pathlib.Path) -> tuple[str, ...] | None:
    """The lines of csrc/'s one file called `name` (a report names files without their folder)."""
    found = sorted(root.rglob(name))
    return tuple(found[0].read_text().splitlines()) if len(found) == 1 else None


def _source_line(access: Access, root: pathlib.Path) -> str | None:
    lines = _source_lines(pathlib.Path(access.file).name, root) if access.file else None
    return lines[access.line - 1] if lines and 0 < access.line <= len(lines) else None


def classify(accesses: list[Access], root: pathlib.Path = CSRC) -> str:
    if accesses and all(any(name in a.function for name in THIRD_PARTY) for a in accesses):
        return "third-party"
    for a in accesses:
        line = _source_line(a, root)
        if line is None or not any(snippet in line for snippet in HANDOFFS):
            return "unexplained"
    return "hand-off" if accesses else "unexplained"


def report(text: str, root: pathlib.Path = CSRC) -> tuple[dict[str, int], list[list[Access]]]:
    counts = {"hand-off": 0, "third-party": 0, "unexplained": 0}
    unexplained = []
    for accesses in parse(text):
        kind = classify(accesses, root)
        counts[kind] += 1
        if kind == "unexplained":
            unexplained.append(accesses)
    return counts, unexplained


def main(argv: list[str]) -> int:
    text = pathlib.Path(argv[1]).read_text()
    counts, unexplained = report(text)
    print(f"racecheck: {counts['hand-off']} on named-barrier hand-offs, {counts['third-party']} in other "
          f"libraries' kernels, {counts['unexplained']} unexplained")
    for accesses in unexplained:
        for a in accesses:
            print(f"  {a.kind} {a.function} {a.file}:{a.line}")
        print()
    summary = _SUMMARY.search(text)
    if _TRUNCATED in text:
        print(f"incomplete: racecheck says \"{_TRUNCATED}\"; rerun with NV_COMPUTE_SANITIZER_MAX_RACECHECK_HAZARDS "
              "set higher")
    elif summary is None or int(summary[1]) != sum(counts.values()):
        print(f"incomplete: {sum(counts.values())} hazards printed, the summary says "
              f"{summary[1] if summary else 'nothing'} (a run cut short, or --print-limit below the count)")
    else:
        return 1 if unexplained else 0
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
