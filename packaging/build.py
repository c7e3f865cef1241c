#!/usr/bin/env python3
"""Build the FTIS installers into dist/installers/ (``make installers``).

* ``install.sh``  Linux/macOS installer: pins of packaging/versions and the systemd unit
  and LaunchAgent templates inlined, so the one file works through ``curl | sh``;
* ``install.ps1`` Windows one-liner: pins and ftis-launch.py inlined;
* ``ftis-client-<version>-windows-x64-setup.exe``: NSIS (``makensis``, Debian's nsis
  package) carrying uv.exe from uv's own win_amd64 wheel (``pip download``);
* ``SHA256SUMS``.

The macOS .pkg is built on macOS by packaging/macos/build-pkg.sh (from the install.sh
built here). Downloads are cached in build/installers/. ``--uv-for-host`` also extracts
the uv binary for this machine (manylinux/macOS wheel), which the installer tests use.
Only the standard library is needed (and pip, for the uv wheels).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CACHE = ROOT / "build" / "installers"

PIN_KEYS = ("UV_VERSION", "PYTHON_VERSION", "TORCH_VERSION")


def read_versions(path: Path = HERE / "versions") -> dict[str, str]:
    """``KEY=VALUE`` pins plus ``FTIS_VERSION`` (client/pyproject.toml)."""
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, value = line.split("=", 1)
            pins[key.strip()] = value.strip()
    missing = [k for k in PIN_KEYS if k not in pins]
    if missing:
        raise SystemExit(f"{path}: missing {', '.join(missing)}")
    client = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())
    pins["FTIS_VERSION"] = client["project"]["version"]
    return pins


def replace_block(text: str, name: str, body: str) -> str:
    """Replace the lines between ``# @@BEGIN NAME`` and ``# @@END NAME`` (markers kept)."""
    pattern = re.compile(rf"(^# @@BEGIN {name}\b[^\n]*\n).*?(^# @@END {name}\n)",
                         re.S | re.M)
    if not pattern.search(text):
        raise SystemExit(f"no @@BEGIN/@@END {name} block")
    return pattern.sub(lambda m: m.group(1) + body + m.group(2), text, count=1)


def heredoc_function(name: str, content: str) -> str:
    tag = "FTIS_TEMPLATE_EOF"
    if tag in content:
        raise SystemExit(f"template for {name} contains {tag}")
    return f"{name}() {{\n    cat <<'{tag}'\n{content.rstrip()}\n{tag}\n}}\n"


def build_install_sh(pins: dict[str, str]) -> str:
    text = (HERE / "linux" / "install.sh").read_text()
    text = replace_block(text, "PINS", (
        f"FTIS_INSTALLER_VERSION={pins['FTIS_VERSION']}\n"
        f"UV_VERSION={pins['UV_VERSION']}\n"
        f"PYTHON_VERSION={pins['PYTHON_VERSION']}\n"
        f"TORCH_VERSION={pins['TORCH_VERSION']}\n"))
    text = replace_block(text, "TEMPLATES", heredoc_function(
        "systemd_unit_template", (HERE / "linux" / "ftis-client.service.in").read_text())
        + heredoc_function("launch_agent_template",
                           (HERE / "macos" / "org.ftis.client.plist.in").read_text()))
    return text


def build_install_ps1(pins: dict[str, str]) -> str:
    text = (HERE / "windows" / "install.ps1").read_text()
    text = replace_block(text, "PINS", (
        f"$FtisInstallerVersion = '{pins['FTIS_VERSION']}'\n"
        f"$UvVersion = '{pins['UV_VERSION']}'\n"
        f"$PythonVersion = '{pins['PYTHON_VERSION']}'\n"
        f"$TorchVersion = '{pins['TORCH_VERSION']}'\n"))
    launcher = (HERE / "windows" / "ftis-launch.py").read_text()
    if "'@" in launcher:
        raise SystemExit("ftis-launch.py must not contain '@ (PowerShell here-string end)")
    return replace_block(text, "LAUNCHER",
                         f"function Get-LauncherSource {{ @'\n{launcher.rstrip()}\n'@ }}\n")


def versions_txt(pins: dict[str, str]) -> str:
    return (f"ftis-client={pins['FTIS_VERSION']}\nuv={pins['UV_VERSION']}\n"
            f"python={pins['PYTHON_VERSION']}\ntorch={pins['TORCH_VERSION']}\n")


def uv_wheel(version: str, platform_tag: str) -> Path:
    """uv's wheel for ``platform_tag`` from PyPI (pip download), cached."""
    dest = CACHE / "wheels"
    dest.mkdir(parents=True, exist_ok=True)
    tag = platform_tag.split(".")[0]
    found = sorted(dest.glob(f"uv-{version}-py3-none-*{tag}*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet",
                        "--disable-pip-version-check", f"uv=={version}", "--only-binary=:all:",
                        "--platform", platform_tag, "--no-deps", "-d", str(dest)], check=True)
        found = sorted(dest.glob(f"uv-{version}-py3-none-*{tag}*.whl"))
    if not found:
        raise SystemExit(f"pip download did not give a uv {version} wheel for {platform_tag}")
    return found[0]


def extract_uv(wheel: Path, name: str, out: Path) -> Path:
    with zipfile.ZipFile(wheel) as z:
        member = next(m for m in z.namelist() if m.endswith(f".data/scripts/{name}"))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(z.read(member))
    out.chmod(out.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return out


def host_uv_platform() -> str:
    machine = platform.machine().lower()
    if sys.platform.startswith("linux"):
        return {"x86_64": "manylinux_2_17_x86_64", "amd64": "manylinux_2_17_x86_64",
                "aarch64": "manylinux_2_17_aarch64"}[machine]
    if sys.platform == "darwin":
        return "macosx_11_0_arm64" if machine == "arm64" else "macosx_10_12_x86_64"
    raise SystemExit(f"no uv wheel for {sys.platform} {machine}")


def find_makensis() -> str:
    found = shutil.which("makensis")
    if found:
        return found
    for base in (os.environ.get("ProgramFiles(x86)"), os.environ.get("ProgramFiles")):
        if base and (Path(base) / "NSIS" / "makensis.exe").is_file():
            return str(Path(base) / "NSIS" / "makensis.exe")
    raise SystemExit("makensis not found: install NSIS (Debian: apt-get install nsis)")


def build_setup_exe(pins: dict[str, str], ps1: str, out: Path) -> Path:
    stage = CACHE / "windows-stage"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    extract_uv(uv_wheel(pins["UV_VERSION"], "win_amd64"), "uv.exe", stage / "uv.exe")
    (stage / "install.ps1").write_text(ps1, newline="\r\n")
    shutil.copy(HERE / "windows" / "ftis-launch.py", stage / "ftis-launch.py")
    (stage / "versions.txt").write_text(versions_txt(pins), newline="\r\n")
    exe = out / f"ftis-client-{pins['FTIS_VERSION']}-windows-x64-setup.exe"
    sep = "\\" if os.name == "nt" else "/"
    defines = {"VERSION": pins["FTIS_VERSION"], "UV_VERSION": pins["UV_VERSION"],
               "PYTHON_VERSION": pins["PYTHON_VERSION"],
               "TORCH_VERSION": pins["TORCH_VERSION"], "STAGE": str(stage), "OUTFILE": str(exe)}
    flag = "/" if os.name == "nt" else "-"
    cmd = [find_makensis(), f"{flag}V2", f"{flag}INPUTCHARSET", "UTF8"]
    cmd += [f"{flag}D{k}={v}" for k, v in defines.items()]
    nsi = (HERE / "windows" / "ftis-client.nsi").read_text()
    if sep == "/":  # makensis on Linux takes / in File paths
        nsi = nsi.replace("${STAGE}\\", "${STAGE}/")
    script = CACHE / "ftis-client.nsi"
    script.write_text(nsi)
    subprocess.run([*cmd, str(script)], check=True)
    return exe


def write_executable(path: Path, text: str) -> None:
    path.write_text(text, newline="\n")
    path.chmod(0o755)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "dist" / "installers")
    ap.add_argument("--targets", default="sh,ps1,windows",
                    help="comma-separated: sh (install.sh), ps1 (install.ps1), windows "
                         "(setup.exe)")
    ap.add_argument("--uv-for-host", type=Path, metavar="PATH",
                    help="also extract this machine's uv binary to PATH")
    args = ap.parse_args(argv)
    targets = {t.strip() for t in args.targets.split(",") if t.strip()}
    unknown = targets - {"sh", "ps1", "windows"}
    if unknown:
        ap.error(f"unknown targets {sorted(unknown)}")
    pins = read_versions()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    made: list[Path] = []
    ps1 = build_install_ps1(pins)
    if "sh" in targets:
        write_executable(out / "install.sh", build_install_sh(pins))
        made.append(out / "install.sh")
    if "ps1" in targets:
        (out / "install.ps1").write_text(ps1, newline="\r\n")
        made.append(out / "install.ps1")
    if "windows" in targets:
        made.append(build_setup_exe(pins, ps1, out))
    (out / "versions.txt").write_text(versions_txt(pins))
    made.append(out / "versions.txt")
    if args.uv_for_host:
        name = "uv.exe" if os.name == "nt" else "uv"
        extract_uv(uv_wheel(pins["UV_VERSION"], host_uv_platform()), name, args.uv_for_host)
    sums = "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n"
                   for p in sorted(made))
    (out / "SHA256SUMS").write_text(sums)
    for p in sorted(made):
        print(f"{p.stat().st_size / 1e6:8.2f} MB  {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
