"""tests/racecheck_report.py on reports written here in racecheck's format, pointing at csrc/'s real
lines (found by their text, so the tests follow the sources as they change)."""

import pathlib

import pytest
import racecheck_report as rr

CSRC = pathlib.Path(__file__).resolve().parents[1] / "csrc"


def _line_of(file: str, text: str) -> int:
    lines = next(CSRC.rglob(file)).read_text().splitlines()
    found = [i + 1 for i, line in enumerate(lines) if text in line]
    assert found, f"{text!r} is not in {file}"
    return found[0]


def _access(kind: str, function: str, file: str | None = None, text: str | None = None) -> str:
    where = f" in {file}:{_line_of(file, text)}" if file else ""
    return f"{kind} access at void {function}(dsv4::sparse_attn::Params)+0x1a10{where}"


def _report(*hazards: tuple[str, ...], truncated: bool = False, shown_less: int = 0) -> str:
    blocks = ["========= COMPUTE-SANITIZER"]
    if truncated:
        blocks += ["========= Warning: Maximum number of hazards reached. Environment variable "
                   "NV_COMPUTE_SANITIZER_MAX_RACECHECK_HAZARDS can be used to increase this count.", "========= "]
    for first, *others in hazards:
        blocks.append(f"========= Error: Race reported between {first}")
        blocks += [f"=========     and {o} [2048 hazards]" for o in others]
        blocks.append("========= ")
    errors = len(hazards) + shown_less
    blocks.append(f"========= RACECHECK SUMMARY: {errors} hazards displayed ({errors} errors, 0 warnings)")
    return "\n".join(blocks) + "\n"


HANDOFF = (_access("Read", "dsv4::sparse_attn::value_tiles", "sparse_attn.cu", "= sm.handoff[b][w][t]"),
           _access("Write", "dsv4::sparse_attn::score_tiles", "sparse_attn.cu", "sm.handoff[b][w][t] ="))
MASK = (_access("Read", "dsv4::sparse_attn::scores<(int)8>", "small_heads.cu", "= sm.mask[b][0]"),
        _access("Write", "dsv4::sparse_attn::dequant_unit<(int)0>", "pipeline.cuh", "sm.mask[buf][part] = m"))
# The lse store is global memory read by the combine kernel: no hand-off names it.
LSE = (_access("Write", "dsv4::sparse_attn::sparse_attn_kernel<(int)0, (int)0>", "sparse_attn.cu", "p.lse["),
       _access("Read", "dsv4::sparse_attn::value_tiles", "sparse_attn.cu", "= sm.handoff[b][w][t]"))
CUBLAS = ("Write access at nvjet_sm90_tst_128x64_64x8_1x1_v_bz_coopB_TNT+0x7f0",
          "Read access at nvjet_sm90_tst_128x64_64x8_1x1_v_bz_coopB_TNT+0x810")


def test_parse_reads_every_access():
    hazards = rr.parse(_report(HANDOFF, (HANDOFF[0], HANDOFF[1], MASK[0])))
    assert [len(h) for h in hazards] == [2, 3]
    first = hazards[0][0]
    assert (first.kind, first.file, first.line) == ("Read", "sparse_attn.cu",
                                                     _line_of("sparse_attn.cu", "= sm.handoff[b][w][t]"))
    assert "value_tiles" in first.function


def test_hand_offs_and_third_party_pass():
    counts, unexplained = rr.report(_report(HANDOFF, MASK, CUBLAS))
    assert counts == {"hand-off": 2, "third-party": 1, "unexplained": 0}
    assert unexplained == []


@pytest.mark.parametrize("hazard", [LSE, (HANDOFF[0], LSE[0]),
                                    # no line info: a dsv4ops kernel built without -lineinfo
                                    (_access("Read", "dsv4::sparse_attn::value_tiles"), HANDOFF[1]),
                                    (CUBLAS[0], HANDOFF[0])],
                         ids=["unnamed line", "one side unnamed", "no line info", "cuBLAS against ours"])
def test_anything_else_is_unexplained(hazard, tmp_path, capsys):
    log = tmp_path / "race.log"
    log.write_text(_report(HANDOFF, hazard))
    assert rr.main(["racecheck_report.py", str(log)]) == 1
    out = capsys.readouterr().out
    assert "1 on named-barrier hand-offs" in out and "1 unexplained" in out


def test_every_named_hand_off_is_in_csrc():
    sources = "\n".join(p.read_text() for p in CSRC.rglob("*") if p.suffix in (".cu", ".cuh"))
    assert [s for s in rr.HANDOFFS if s not in sources] == []


def test_clean_report_exits_zero(tmp_path):
    log = tmp_path / "race.log"
    log.write_text(_report(HANDOFF, CUBLAS))
    assert rr.main(["racecheck_report.py", str(log)]) == 0


def test_truncated_report_fails(tmp_path, capsys):
    """Past its hazard limit racecheck stops recording: a report without an unexplained hazard is still
    not a clean one."""
    log = tmp_path / "race.log"
    log.write_text(_report(HANDOFF, CUBLAS, truncated=True))
    assert rr.main(["racecheck_report.py", str(log)]) == 1
    assert "incomplete" in capsys.readouterr().out


@pytest.mark.parametrize("text", [_report(HANDOFF, shown_less=1), _report(HANDOFF).rsplit("=========", 1)[0]],
                         ids=["fewer printed than counted", "no summary"])
def test_cut_report_fails(text, tmp_path, capsys):
    log = tmp_path / "race.log"
    log.write_text(text)
    assert rr.main(["racecheck_report.py", str(log)]) == 1
    assert "incomplete" in capsys.readouterr().out
