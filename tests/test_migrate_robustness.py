"""`lightning-mm migrate` on hostile input: never overwrites, linear time, bounded expansion, one-line errors."""

from __future__ import annotations

import time

import pytest

from lightning_mm.cli import main as cli_main
from lightning_mm.mindspeed.keys import MindSpeedConfigError as MigrateError
from lightning_mm.mindspeed.launch_script import MAX_EXPANDED_BYTES, parse_script

LAUNCH = "torchrun --nproc_per_node 2 train.py --lr 1e-4\n"


def _run(capsys, *args: str) -> tuple[int, list[str]]:
    status = cli_main(["migrate", *args])
    return status, capsys.readouterr().err.strip().splitlines()


def test_never_overwrites_its_input_or_an_existing_output(tmp_path, capsys):
    script = tmp_path / "mine.sh"
    script.write_text(LAUNCH)
    status, err = _run(capsys, str(script), "-o", str(script))
    assert status == 1 and err == [
        f"lightning-mm migrate: error: -o {script} is the input {script}; migrate never overwrites its input"
    ]
    status, _ = _run(capsys, str(script), "-o", str(script), "--force")  # not even with --force
    assert status == 1 and script.read_text() == LAUNCH
    link = tmp_path / "link.sh"
    link.symlink_to(script)
    assert _run(capsys, str(script), "-o", str(link), "--force")[0] == 1 and script.read_text() == LAUNCH
    existing = tmp_path / "cfg.yaml"
    existing.write_text("mine\n")
    status, err = _run(capsys, str(script), "-o", str(existing))
    assert status == 1 and err[-1].endswith("exists; pass --force to overwrite it") and existing.read_text() == "mine\n"
    assert _run(capsys, str(script), "-o", str(existing), "--force")[0] == 0
    assert "lr: 0.0001" in existing.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.yaml", "link.sh", "mine.sh"]  # no temporary left


def test_a_yaml_input_is_never_overwritten_either(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text("gpt_args: {lr: 1.0e-5}\n")
    assert _run(capsys, str(job), "-o", str(job), "--force")[0] == 1
    assert job.read_text() == "gpt_args: {lr: 1.0e-5}\n"


def test_an_unclosed_quote_is_linear_and_named(tmp_path):
    text = 'A="open\n' + "x=1\n" * 8000 + LAUNCH
    start = time.perf_counter()
    with pytest.raises(MigrateError, match=r"^s.sh:1: unterminated \" quote$"):
        parse_script(text, "s.sh")
    assert time.perf_counter() - start < 2.0
    text = "A='closed\n" + "x=1\n" * 8000 + "'\n" + LAUNCH  # a quoted value over 8000 lines: fine, and fast
    start = time.perf_counter()
    assert parse_script(text, "s.sh").script == "train.py"
    assert time.perf_counter() - start < 2.0


def test_doubling_variables_stop_with_the_line(tmp_path, capsys):
    names = [f"V{i}" for i in range(40)]
    lines = ["V0=x"] + [f"{b}=${a}${a}" for a, b in zip(names, names[1:])]
    script = tmp_path / "bomb.sh"
    script.write_text("\n".join(lines) + "\n" + LAUNCH)
    assert script.stat().st_size < 700
    start = time.perf_counter()
    status, err = _run(capsys, str(script))
    assert time.perf_counter() - start < 2.0
    line = 1 + next(i for i in range(40) if 2**i > MAX_EXPANDED_BYTES // 2)
    assert status == 1 and len(err) == 1
    assert err[0].startswith(f"lightning-mm migrate: error: {script}:{line}: variable expansion grows past 1024 KiB")


def test_many_small_expansions_are_bounded_too():
    text = "A=x\n" + "B=" + "$A" * 200_000 + "\n" + LAUNCH
    with pytest.raises(MigrateError, match="substitutions"):
        parse_script(text, "s.sh")


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\x7fELF\x02\x01\x01\x00\x00", "a binary file (NUL byte)"),
        ("A=1\nB=caf\u00e9\n".encode("latin-1") + LAUNCH.encode(), "2: not UTF-8 text (byte 0xe9)"),
    ],
)
def test_binary_and_non_utf8_scripts_are_one_line(tmp_path, capsys, content, message):
    script = tmp_path / "launch.sh"
    script.write_bytes(content)
    status, err = _run(capsys, str(script))
    assert status == 1 and len(err) == 1 and f"{script}:" in err[0] and message in err[0], err


@pytest.mark.parametrize(
    "body",
    [
        "-" * 100_000 + "1",  # MemoryError from ast.parse
        "1" + "+1" * 1_000_000,
    ],
)  # RecursionError from ast.parse
def test_an_entry_script_too_deep_for_ast_is_one_line(tmp_path, capsys, body):
    (tmp_path / "train.py").write_text(f"x = {body}\n")
    script = tmp_path / "launch.sh"
    script.write_text(LAUNCH)
    status, err = _run(capsys, str(script))
    assert status == 1 and len(err) == 1, err
    assert f"{tmp_path / 'train.py'}" in err[0] and "nested too deeply" in err[0]


def test_an_entry_script_that_is_not_utf8_is_one_line(tmp_path, capsys):
    script = tmp_path / "launch.sh"
    script.write_text(LAUNCH)
    (tmp_path / "train.py").write_bytes(b"def model_provider():\n    return '\xff'\n")
    status, err = _run(capsys, str(script))
    assert status == 1 and len(err) == 1 and "train.py:2: not UTF-8 text" in err[0], err


def test_launch_lines_stop_at_pipes_and_evaluate_arithmetic():
    text = (
        "N=4\nM=2\nW=$(($N*$M))\nGBS=$(($W*2))\n"
        "torchrun --nproc_per_node $N train.py --global-batch-size $GBS 2>&1 | tee log.txt\n"
    )
    launch = parse_script(text, "s.sh")
    assert launch.flags == [("--global-batch-size", "16")]
    assert launch.env["W"] == "8"
