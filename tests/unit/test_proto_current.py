"""The committed generated stubs are exactly what protoc produces from the .proto files."""

import shutil
import subprocess
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parents[2] / "proto"


def test_generated_stubs_are_current(tmp_path):
    src = tmp_path / "ftis" / "v1"
    src.mkdir(parents=True)
    protos = sorted((PROTO_ROOT / "ftis" / "v1").glob("*.proto"))
    assert protos, "no .proto files found"
    for p in protos:
        shutil.copy(p, src / p.name)
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--pyi_out=.",
         "--grpc_python_out=.", *[f"ftis/v1/{p.name}" for p in protos]],
        cwd=tmp_path, check=True,
    )
    generated = sorted(f for f in src.iterdir() if f.suffix in (".py", ".pyi"))
    assert generated
    stale = [f.name for f in generated
             if not (PROTO_ROOT / "ftis" / "v1" / f.name).exists()
             or (PROTO_ROOT / "ftis" / "v1" / f.name).read_bytes() != f.read_bytes()]
    assert not stale, f"generated stubs differ from the committed ones: {stale}; run `make proto`"
