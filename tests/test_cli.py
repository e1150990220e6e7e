"""The ``fwdtrace`` command's shared parts: factory loading, shapes, exit codes, closed pipes."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fwdtrace
from fwdtrace import FwdtraceError
from fwdtrace.cli import build_parser, load_factory, main, make_inputs, parse_shape

TESTS = Path(__file__).parent

BAD_SHAPES = [("1,3,x", "'1,3,x'"), ("", "''"), ("1,0,4", "'1,0,4'"), ("-1,3", "'-1,3'")]


def test_parse_shape() -> None:
    assert parse_shape("1,3,224,224") == (1, 3, 224, 224)
    assert parse_shape("2x8") == (2, 8)


@pytest.mark.parametrize("text, shown", BAD_SHAPES)
def test_bad_shapes(text: str, shown: str) -> None:
    with pytest.raises(FwdtraceError, match=rf"^expected --input-shape as positive integers .* got {shown}"):
        parse_shape(text)


def test_load_factory() -> None:
    model = load_factory("zoo:ResNetish")
    assert isinstance(model, torch.nn.Module) and type(model).__name__ == "ResNetish"
    with pytest.raises(FwdtraceError, match=r"^expected a factory as 'pkg.module:function', got 'zoo'"):
        load_factory("zoo")
    with pytest.raises(FwdtraceError, match=r"^could not import 'no_such_pkg' for factory"):
        load_factory("no_such_pkg:make")
    with pytest.raises(FwdtraceError, match=r"^zoo:nothing: module 'zoo' has no attribute 'nothing'"):
        load_factory("zoo:nothing")
    with pytest.raises(FwdtraceError, match=r"^factory 'zoo:resnetish' expected to return a torch.nn.Module, got tuple"):
        load_factory("zoo:resnetish")  # returns (model, inputs)


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["no-such-command"]) == 2
    assert main(["analyze", "zoo:ResNetish", "--input-shape", "1,3,x"]) == 2
    assert "expected --input-shape" in capsys.readouterr().err


HELP_WITHOUT_TORCH = """
import contextlib, io, json, sys
from fwdtrace.cli import _COMMANDS, main
helps = {}
for argv in [["--help"], *([name, "--help"] for name in _COMMANDS)]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    helps[" ".join(argv)] = [code, out.getvalue()]
print(json.dumps({"torch": "torch" in sys.modules, "helps": helps}))
"""


def test_help_imports_no_torch() -> None:
    """``fwdtrace --help`` and every ``fwdtrace COMMAND --help`` answer without importing torch."""
    import json

    from fwdtrace.cli import _COMMANDS

    done = subprocess.run([sys.executable, "-c", HELP_WITHOUT_TORCH], capture_output=True, text=True, check=True)
    result = json.loads(done.stdout)
    assert result["torch"] is False
    assert sorted(result["helps"]) == sorted(["--help", *(f"{name} --help" for name in _COMMANDS)])
    for argv, (code, text) in result["helps"].items():
        command = argv.split()[0] if argv != "--help" else ""
        assert code == 0 and text.startswith(f"usage: fwdtrace {command}".rstrip()), (argv, text[:200])
    assert all(name in result["helps"]["--help"][1] for name in _COMMANDS)
    assert "--input-shape" in result["helps"]["draw --help"][1] and "--only-diverged" in result["helps"]["dump-diff --help"][1]


def test_check_onnx_offers_the_exporters_check_onnx_takes() -> None:
    from fwdtrace.cli import CHECK_EXPORTERS
    from fwdtrace.onnx import compare

    assert CHECK_EXPORTERS == compare.CHECK_EXPORTERS


def test_a_closed_pipe_is_not_a_crash() -> None:
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    command = [sys.executable, "-m", "fwdtrace.cli", "analyze", "zoo:ResNetish", "--input-shape", "1,3,16,16",
               "--json", "--repeats", "1", "--warmup", "1"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # as `| head` does once it has read enough; here before anything is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "BrokenPipeError" not in err


# -- the exit-code contract, run as a CI job runs it ----------------------------------------------
MODELS_PY = '''
import torch

def make_ok():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())

def make_raises():
    raise RuntimeError("broken factory")

def make_exits():
    import sys
    sys.exit(0)


class ExitingForward(torch.nn.Module):
    def forward(self, x):
        import sys
        sys.exit(0)


def make_exiting_forward():
    return ExitingForward()


class CrashesTheExporter(torch.nn.Module):
    def forward(self, x):
        if torch.onnx.is_in_onnx_export():
            import os, signal
            os.kill(os.getpid(), signal.SIGFPE)
        return x * 2


def make_crashing():
    return CrashesTheExporter()


def make_sized(width):
    return torch.nn.Linear(width, width)

def make_custom():
    @torch.library.custom_op("cli_test::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    class Twice(torch.nn.Module):
        def forward(self, x):
            return twice(x)

    return torch.nn.Sequential(torch.nn.Linear(4, 4), Twice())
'''

OK = "models:make_ok"
# (argv, exit code, start of stderr's one line or of stdout); DUMP_* are filled in by the test
EXIT_CODES = [
    (["--version"], 0, "stdout:fwdtrace " + fwdtrace.__version__),
    (["analyze", OK, "--input-shape", "2,4", "--warmup", "1", "--repeats", "1"], 0, "stdout:Sequential on cpu"),
    (["check-onnx", OK, "--input-shape", "2,4", "--exporter", "torchscript"], 0, "stdout:"),
    (["dump-diff", "DUMP_A", "DUMP_A"], 0, "stdout:"),
    (["check-onnx", OK, "--input-shape", "2,4", "--exporter", "fwdtrace"], 0, "stdout:"),
    (["export-onnx", OK, "--input-shape", "2,4", "-o", "ok.onnx"], 0,
     "stdout:wrote ok.onnx: 3 nodes, inputs input, outputs output"),
    (["export-onnx", OK, "--input-shape", "2,4"], 2, "usage: fwdtrace export-onnx"),
    (["export-onnx", "models:make_custom", "--input-shape", "2,4", "-o", "custom.onnx"], 2,
     "fwdtrace export-onnx: error: to_onnx() found 1 op with no ONNX translation: cli_test.twice (in '1' (models.make_custom.<locals>.Twice))"),
    (["export-onnx", OK, "--input-shape", "2,5", "-o", "bad.onnx"], 2,
     "fwdtrace export-onnx: error: to_onnx() could not run Sequential on float32[2, 5]: RuntimeError: "),
    (["dump-diff", "DUMP_A", "DUMP_B"], 1, "stdout:"),
    (["analyze"], 2, "usage: fwdtrace analyze"),
    (["analyze", "models:make_raises", "--input-shape", "2,4"], 2,
     "fwdtrace analyze: error: factory 'models:make_raises' raised RuntimeError: broken factory"),
    (["check-onnx", "models:make_crashing", "--input-shape", "2,4", "--exporter", "torchscript", "--isolate"], 2,
     "fwdtrace check-onnx: error: check_onnx(): the torchscript ONNX exporter crashed on CrashesTheExporter: its "
     "process was killed by SIGFPE"),
    (["check-onnx", "models:make_sized", "--input-shape", "2,4"], 2,
     "fwdtrace check-onnx: error: factory 'models:make_sized' expected to be callable without arguments, got make_sized(width)"),
    (["analyze", OK, "--input-shape", "100000,100000,1000"], 2,
     "fwdtrace analyze: error: expected --input-shape that fits in memory, got '100000,100000,1000'"),
    (["analyze", OK, "--input-shape", "2,4", "--device", "cuda"], 2,
     "fwdtrace analyze: error: expected --device as a device this machine has, got 'cuda'"),
    (["check-onnx", OK, "--input-shape", "2,5", "--exporter", "torchscript"], 2,
     "fwdtrace check-onnx: error: models:make_ok: the forward failed on inputs float32[2, 5]: RuntimeError: "),
    (["dump-diff", "DUMP_A", "DUMP_TRUNCATED"], 2,
     "fwdtrace dump-diff: error: compare_dumps() expected an HDF5 dump file, got 'DUMP_TRUNCATED', which HDF5 cannot open "
     "(incomplete: it was cut short while being written"),
    (["dump-diff", "DUMP_A", "DUMP_A", "--rtol", "-1"], 2,
     "fwdtrace dump-diff: error: compare_dumps() expected rtol as a finite number >= 0, got -1.0"),
    (["draw", OK, "--input-shape", "2,4", "-o", "ok.svg"], 0, "stdout:wrote ok.svg: 4 nodes (2 modules), 3 edges"),
    (["draw", OK, "--input-shape", "2,5", "-o", "bad.svg"], 2,
     "fwdtrace draw: error: models:make_ok: the forward failed on inputs float32[2, 5]: RuntimeError: "),
    (["serve", OK, "--input-shape", "2,5", "--port", "0"], 2,
     "fwdtrace serve: error: models:make_ok: the forward failed on inputs float32[2, 5]: RuntimeError: "),
    (["serve", OK, "--input-shape", "2,4", "--dtype", "int8", "--port", "0"], 2, "usage: fwdtrace serve"),
    (["dump-diff", "DUMP_A", "no_such.hdf5"], 2,
     "fwdtrace dump-diff: error: compare_dumps() expected an HDF5 dump file, got 'no_such.hdf5', which does not exist"),
]


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CI job's working directory: models.py beside it, two dumps and a truncated one."""
    folder = tmp_path_factory.mktemp("job")
    (folder / "models.py").write_text(MODELS_PY)
    for name, scale in (("a", 1.0), ("b", 2.0)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(2, 2))
        with torch.no_grad():
            model[0].weight.mul_(scale)
        with fwdtrace.Dumper(folder / name) as dumper:
            dumper.register(model)
            model(torch.ones(1, 2)).sum().backward()
        dumper.paths[0].rename(folder / f"{name}.hdf5")
    data = (folder / "a.hdf5").read_bytes()
    (folder / "truncated.hdf5").write_bytes(data[: len(data) // 2])
    return folder


def _fill(argv: list[str], expected: str) -> tuple[list[str], str]:
    names = {"DUMP_A": "a.hdf5", "DUMP_B": "b.hdf5", "DUMP_TRUNCATED": "truncated.hdf5"}
    return [names.get(a, a) for a in argv], expected.replace("DUMP_TRUNCATED", "truncated.hdf5")


def _assert_contract(code: int, out: str, err: str, expected_code: int, expected: str) -> None:
    assert code == expected_code, err
    assert "Traceback" not in err
    if expected.startswith("stdout:"):
        assert out.startswith(expected.removeprefix("stdout:")), out
    elif expected.startswith("usage:"):
        assert err.startswith(expected)
    else:
        assert err.startswith(expected), err
        assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv, code, expected", EXIT_CODES, ids=[" ".join(c[0][:3]) + f" -> {c[1]}" for c in EXIT_CODES])
def test_every_subcommand_keeps_the_exit_code_contract(job_dir: Path, argv: list[str], code: int, expected: str,
                                                       capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """What the console script returns and prints, through the function it calls (the script itself:
    test_the_console_script_keeps_the_contract)."""
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    argv, expected = _fill(argv, expected)
    monkeypatch.chdir(job_dir)
    monkeypatch.delitem(sys.modules, "models", raising=False)  # job_dir's models.py, not another test's
    capsys.readouterr()
    returned = main(argv)
    captured = capsys.readouterr()
    _assert_contract(returned, captured.out, captured.err, code, expected)


def test_the_console_script_keeps_the_contract(job_dir: Path) -> None:
    """The installed ``fwdtrace`` script, in its own process, for a usage error and a model error (its
    successes: test_analysis's and test_onnx_compare's installed-command tests)."""
    command = Path(sys.executable).parent / "fwdtrace"  # the console script: sys.path[0] is its folder, not cwd
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("PYTHONPATH", None)
    rows = [r for r in EXIT_CODES if (r[0][:1] == ["draw"] and r[1] == 2) or r[0] == ["analyze"]]
    assert len(rows) == 2
    for argv, code, expected in rows:
        argv, expected = _fill(argv, expected)
        done = subprocess.run([str(command), *argv], capture_output=True, text=True, env=env, cwd=job_dir, timeout=300)
        _assert_contract(done.returncode, done.stdout, done.stderr, code, expected)


def test_traceback_prints_the_details(job_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(job_dir)
    for argv in (["--traceback", "analyze", "models:make_raises", "--input-shape", "2"],
                 ["analyze", "models:make_raises", "--input-shape", "2", "--traceback"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback (most recent call last)" in err and 'raise RuntimeError("broken factory")' in err
        assert err.strip().splitlines()[-1] == "fwdtrace analyze: error: factory 'models:make_raises' raised RuntimeError: broken factory"


USER_EXITS = [
    (["analyze", "models:make_exits", "--input-shape", "2,4"],
     "fwdtrace analyze: error: factory 'models:make_exits' called sys.exit(0) (--traceback for details)"),
    (["check-onnx", "models:make_exiting_forward", "--input-shape", "2,4"],
     "fwdtrace check-onnx: error: models:make_exiting_forward: the model's code called sys.exit(0) (--traceback for details)"),
    (["analyze", "models:make_exiting_forward", "--input-shape", "2,4"],
     "fwdtrace analyze: error: models:make_exiting_forward: the model's code called sys.exit(0) (--traceback for details)"),
    (["dump-diff", "a.hdf5", "/dev/zero"],
     "fwdtrace dump-diff: error: compare_dumps() expected an HDF5 dump file, got '/dev/zero', which is not a regular "
     "file but a character device"),
    (["dump-diff", "pipe.hdf5", "a.hdf5"],
     "fwdtrace dump-diff: error: compare_dumps() expected an HDF5 dump file, got 'pipe.hdf5', which is not a regular "
     "file but a named pipe (FIFO)"),
]


@pytest.mark.parametrize("argv, expected", USER_EXITS, ids=[" ".join(argv[:2]) for argv, _ in USER_EXITS])
def test_user_code_cannot_end_the_command_silently_and_odd_paths_are_named(
    job_dir: Path, argv: list[str], expected: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """sys.exit(0) in a factory or a forward is an error (exit 2), not the command's success; a device or a
    FIFO given as a file is named as such (a FIFO would block a reader, /dev/zero never ends)."""
    if not os.path.exists(job_dir / "pipe.hdf5"):
        os.mkfifo(job_dir / "pipe.hdf5")
    monkeypatch.chdir(job_dir)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == expected


def test_every_command_that_runs_a_model_makes_the_same_inputs() -> None:
    for dtype in ("float32", "bfloat16", "int64"):
        made = []
        for command in ("analyze", "check-onnx", "draw", "serve"):
            argv = [command, "m:f", "--input-shape", "2,3", "--input-shape", "4", "--dtype", dtype, "-o", "g.svg"]
            args, _ = build_parser().parse_known_args(argv)
            made.append(make_inputs(args))
        assert [t.dtype for t in made[0]] == [getattr(torch, dtype)] * 2
        for other in made[1:]:
            for a, b in zip(made[0], other, strict=True):
                assert torch.equal(a, b)
        if dtype == "int64":
            assert all(int(t.min()) >= 0 and int(t.max()) < 10 for t in made[0])
        else:  # seeded normal values, as torch.randn draws them
            expected = torch.randn((2, 3), generator=torch.Generator().manual_seed(0)).to(getattr(torch, dtype))
            assert torch.equal(made[0][0], expected)


def test_export_onnx_writes_a_model_that_runs_like_torch(job_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np
    import onnxruntime as ort

    monkeypatch.chdir(job_dir)
    torch.manual_seed(0)  # the factory draws its weights: the same ones for the reference below
    assert main(["export-onnx", "zoo:MobileNetish", "--input-shape", "1,3,16,16", "-o", "mobile.onnx"]) == 0
    (x,) = make_inputs(build_parser().parse_args(["export-onnx", "zoo:MobileNetish", "--input-shape", "1,3,16,16", "-o", "unused"]))
    torch.manual_seed(0)
    model = load_factory("zoo:MobileNetish").eval()
    session = ort.InferenceSession(str(job_dir / "mobile.onnx"), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"x": x.numpy()})
    np.testing.assert_allclose(got, model(x).detach().numpy(), rtol=1e-4, atol=1e-6)
    assert not (job_dir / "custom.onnx").exists() and not (job_dir / "bad.onnx").exists()


def test_check_onnx_numeric_exits_1_on_a_divergence(job_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``--onnx FILE --numeric``: 0 for an honest file, 1 for one whose Linear weight was scaled by 1.01."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    monkeypatch.chdir(job_dir)
    assert main(["export-onnx", OK, "--input-shape", "2,4", "-o", "honest.onnx"]) == 0
    proto = onnx.load("honest.onnx")
    (w,) = [i for i in proto.graph.initializer if len(i.dims) == 2]  # the Linear's weight
    w.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(w) * np.float32(1.01), w.name))
    onnx.save(proto, "tampered.onnx")
    # reference: onnxruntime's outputs of the two files differ
    x = make_inputs(argparse.Namespace(input_shape=["2,4"], dtype="float32"))[0].numpy()
    outs = [ort.InferenceSession(f, providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
            for f in ("honest.onnx", "tampered.onnx")]
    assert np.abs(outs[0] - outs[1]).max() > 1e-3
    capsys.readouterr()
    assert main(["check-onnx", OK, "--input-shape", "2,4", "--onnx", "honest.onnx", "--numeric"]) == 0
    assert capsys.readouterr().out.startswith("no divergence: ")
    assert main(["check-onnx", OK, "--input-shape", "2,4", "--onnx", "tampered.onnx"]) == 0  # the structure agrees
    capsys.readouterr()
    assert main(["check-onnx", OK, "--input-shape", "2,4", "--onnx", "tampered.onnx", "--numeric"]) == 1
    assert capsys.readouterr().out.startswith("first divergence: 0, max rel err ")
    assert main(["check-onnx", OK, "--input-shape", "2,4", "--onnx", "tampered.onnx", "--exporter", "dynamo"]) == 2
    assert "check-onnx expected --exporter (export the model) or --onnx (check a given file), not both" \
        in capsys.readouterr().err
