"""The committed generated stubs are exactly what protoc produces from the .proto files."""

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "proto"
#: the generator's own environment (`make proto`, proto/codegen-requirements.txt)
CODEGEN_PYTHON = ROOT / ".venv-codegen" / "bin" / "python"


def test_generated_stubs_are_current(tmp_path):
    src = tmp_path / "ftis" / "v1"
    src.mkdir(parents=True)
    protos = sorted((PROTO_ROOT / "ftis" / "v1").glob("*.proto"))
    assert protos, "no .proto files found"
    for p in protos:
        shutil.copy(p, src / p.name)
    assert CODEGEN_PYTHON.exists(), f"no {CODEGEN_PYTHON}: run `make test-deps` or `make proto`"
    subprocess.run(
        [str(CODEGEN_PYTHON), "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--pyi_out=.",
         "--grpc_python_out=.", *[f"ftis/v1/{p.name}" for p in protos]],
        cwd=tmp_path, check=True,
    )
    generated = sorted(f for f in src.iterdir() if f.suffix in (".py", ".pyi"))
    assert generated
    stale = [f.name for f in generated
             if not (PROTO_ROOT / "ftis" / "v1" / f.name).exists()
             or (PROTO_ROOT / "ftis" / "v1" / f.name).read_bytes() != f.read_bytes()]
    assert not stale, f"generated stubs differ from the committed ones: {stale}; run `make proto`"
