"""The volunteer installers of packaging/ (issue 14, part 1): ``make test-installers``.

Builds the installers with packaging/build.py into a temporary folder, runs the built
install.sh into a temporary HOME (local wheels and this machine's Python through the
documented FTIS_* overrides, since uv's managed CPython downloads are unreachable here),
checks the Windows setup.exe (PE header, payload listed by 7z, pinned versions) and, where
Wine runs, installs it silently into a temporary Wine prefix.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.installers

ROOT = Path(__file__).resolve().parents[2]
PACKAGING = ROOT / "packaging"
CACHE = ROOT / "build" / "installers"
CLIENT_VERSION = tomllib.loads((ROOT / "client/pyproject.toml").read_text())["project"][
    "version"]
SETUP_EXE = f"ftis-client-{CLIENT_VERSION}-windows-x64-setup.exe"


def _load_build():
    spec = importlib.util.spec_from_file_location("ftis_packaging_build", PACKAGING / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _load_build()
PINS = build.read_versions()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """dist/installers built from the working tree (setup.exe only where makensis is)."""
    out = tmp_path_factory.mktemp("installers")
    targets = "sh,ps1,windows" if shutil.which("makensis") else "sh,ps1"
    build.main(["--out", str(out), "--targets", targets,
                "--uv-for-host", str(CACHE / "uv-host" / "uv")])
    return out


# -- pins and generated files --------------------------------------------------------------

def test_versions_file_pins_uv_python_torch_and_client_version() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", PINS["UV_VERSION"])
    assert re.fullmatch(r"3\.\d+\.\d+", PINS["PYTHON_VERSION"])
    assert re.fullmatch(r"\d+\.\d+\.\d+", PINS["TORCH_VERSION"])
    assert PINS["FTIS_VERSION"] == CLIENT_VERSION


def test_source_scripts_carry_the_same_pins() -> None:
    """The repository's install.sh / install.ps1 run as they are, so their default pins
    must be those of packaging/versions (build.py rewrites them in dist/ anyway)."""
    sh = (PACKAGING / "linux/install.sh").read_text()
    for key, name in (("FTIS_VERSION", "FTIS_INSTALLER_VERSION"), ("UV_VERSION", "UV_VERSION"),
                      ("PYTHON_VERSION", "PYTHON_VERSION"), ("TORCH_VERSION", "TORCH_VERSION")):
        assert f"\n{name}={PINS[key]}\n" in sh, name
    ps1 = (PACKAGING / "windows/install.ps1").read_text()
    for key, name in (("FTIS_VERSION", "FtisInstallerVersion"), ("UV_VERSION", "UvVersion"),
                      ("PYTHON_VERSION", "PythonVersion"), ("TORCH_VERSION", "TorchVersion")):
        assert f"${name} = '{PINS[key]}'" in ps1, name


def test_built_scripts_are_self_contained(built: Path) -> None:
    sh = (built / "install.sh").read_text()
    assert os.access(built / "install.sh", os.X_OK)
    assert 'dirname "$0"' not in sh  # templates inlined: works through `curl | sh`
    assert "ExecStart=\"@SERVICE_WRAPPER@\"" in sh
    assert "<string>org.ftis.client</string>" in sh
    assert f"\nUV_VERSION={PINS['UV_VERSION']}\n" in sh
    ps1 = (built / "install.ps1").read_text()
    assert "def load_settings" in ps1 and "$PSScriptRoot" not in ps1
    assert (built / "versions.txt").read_text().splitlines() == [
        f"ftis-client={CLIENT_VERSION}", f"uv={PINS['UV_VERSION']}",
        f"python={PINS['PYTHON_VERSION']}", f"torch={PINS['TORCH_VERSION']}"]
    sums = dict(reversed(line.split("  ")) for line in
                (built / "SHA256SUMS").read_text().splitlines())
    assert sums["install.sh"] == hashlib.sha256((built / "install.sh").read_bytes()).hexdigest()


SHELL_SCRIPTS = ["packaging/linux/install.sh", "packaging/macos/build-pkg.sh",
                 "packaging/macos/scripts/postinstall"]


@pytest.mark.skipif(shutil.which("shellcheck") is None,
                    reason="shellcheck not installed (Debian: apt-get install shellcheck; "
                           "make test-installers installs it as root)")
def test_shell_scripts_are_shellcheck_clean(built: Path) -> None:
    paths = [str(ROOT / p) for p in SHELL_SCRIPTS] + [str(built / "install.sh")]
    result = subprocess.run(["shellcheck", "--shell=sh", *paths], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_launcher_reads_client_env(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("ftis_launch",
                                                  PACKAGING / "windows/ftis-launch.py")
    launch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launch)
    env = tmp_path / "client.env"
    env.write_text('# comment\nFTIS_CLIENT_COORDINATOR="10.0.0.1:7000"\r\nFTIS_CLIENT_ROUNDS=0\n'
                   'FTIS_CLIENT_COORDINATOR="10.0.0.2:7000"\n\n')
    assert launch.load_settings(env) == {"FTIS_CLIENT_COORDINATOR": "10.0.0.2:7000",
                                         "FTIS_CLIENT_ROUNDS": "0"}
    assert launch.load_settings(tmp_path / "missing.env") == {}


# -- install.sh into a temporary HOME -----------------------------------------------------

def _find_links() -> tuple[str | None, str]:
    """(FTIS_FIND_LINKS, FTIS_TORCH_BACKEND): the local CPU torch wheel where there is one
    (no torch backend index then), else PyTorch's CPU index (never PyPI's CUDA torch)."""
    folder = os.environ.get("FTIS_TEST_FIND_LINKS", "/opt/wheels")
    if list(Path(folder).glob(f"torch-{PINS['TORCH_VERSION']}*.whl")):
        return folder, "none"
    return None, "cpu"


def _install_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FTIS_", "UV_", "XDG_", "VIRTUAL_ENV", "PYTHON"))}
    find_links, backend = _find_links()
    env.update(
        HOME=str(home),
        PATH=os.pathsep.join(["/usr/local/bin", "/usr/bin", "/bin"]),
        FTIS_UV=str(CACHE / "uv-host" / "uv"),
        FTIS_PYTHON=os.environ.get("FTIS_TEST_PYTHON", os.path.realpath(sys.executable)),
        FTIS_PACKAGE_SPEC=f"{ROOT / 'proto'} {ROOT / 'client'}",
        FTIS_TORCH_BACKEND=backend,
        # a cache that outlives the temporary HOME keeps re-runs of this test fast
        UV_CACHE_DIR=str(CACHE / "uv-cache"),
    )
    if find_links:
        env["FTIS_FIND_LINKS"] = find_links
    return env


def _run(cmd: list[str], env: dict[str, str], timeout: int = 900):
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=env["HOME"])


def test_install_sh_installs_updates_and_uninstalls(built: Path, tmp_path: Path) -> None:
    if sys.platform != "linux":
        pytest.skip("the Linux layout is checked here; macOS runs it in installers.yml")
    home = tmp_path / "home"
    home.mkdir()
    env = _install_env(home)
    script = str(built / "install.sh")

    t0 = time.monotonic()
    first = _run(["sh", script, "--coordinator", "10.1.2.3:7000"], env)
    first_s = time.monotonic() - t0
    assert first.returncode == 0, first.stdout + first.stderr
    prog = home / ".local/share/ftis-client"
    venv = prog / "venv"
    link = home / ".local/bin/ftis-client"
    unit = home / ".config/systemd/user/ftis-client.service"
    settings = home / ".config/ftis/client.env"
    wrapper = prog / "bin/ftis-client-service"
    assert (prog / "bin/uv").is_file()
    assert _run([str(prog / "bin/uv"), "--version"], env).stdout.split()[1] == PINS["UV_VERSION"]
    assert link.is_symlink() and link.resolve() == (venv / "bin/ftis-client").resolve()
    assert (home / ".local/share/ftis/node").is_dir()
    assert 'FTIS_CLIENT_COORDINATOR="10.1.2.3:7000"' in settings.read_text().splitlines()
    assert "FTIS_CLIENT_ROUNDS=0" in settings.read_text().splitlines()
    unit_text = unit.read_text()
    assert f'ExecStart="{wrapper}"' in unit_text
    assert "WantedBy=default.target" in unit_text and "@" not in unit_text.replace(
        "@CONFIG", "")
    torch_version = _run([str(venv / "bin/python"), "-c",
                          "import torch; print(torch.__version__)"], env)
    assert torch_version.stdout.strip().split("+")[0] == PINS["TORCH_VERSION"]

    version = _run([str(link), "--version"], env)
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"ftis-client {CLIENT_VERSION}"
    models = _run([str(link), "models", "list", "--json"], env)
    assert models.returncode == 0, models.stderr
    rows = {r["name"]: r for r in json.loads(models.stdout)}
    assert {"smollm2-135m", "gemma3-270m"} <= set(rows)
    assert rows["smollm2-135m"]["kind"] == "embedded"
    # the slim volunteer package: the volunteer commands only, no ftis-lab
    assert not (venv / "bin/ftis-lab").exists()
    no_lab = _run([str(venv / "bin/python"), "-c",
                   "import importlib.util as u; print(u.find_spec('ftis.lab') is None)"], env)
    assert no_lab.stdout.strip() == "True", no_lab.stderr
    top_help = _run([str(link), "--help"], env)
    assert top_help.returncode == 0 and "attack" not in top_help.stdout
    assert "demo" not in top_help.stdout
    # the service wrapper reads client.env and runs `ftis-client start`
    start_help = _run([str(wrapper), "--help"], env)
    assert start_help.returncode == 0 and "--coordinator" in start_help.stdout

    # idempotent: a second run reuses uv and the environment and keeps the settings
    t0 = time.monotonic()
    second = _run(["sh", script], env)
    second_s = time.monotonic() - t0
    assert second.returncode == 0, second.stdout + second.stderr
    assert "creating the environment" not in second.stdout
    assert 'FTIS_CLIENT_COORDINATOR="10.1.2.3:7000"' in settings.read_text()
    assert _run([str(link), "--version"], env).stdout.strip() == f"ftis-client {CLIENT_VERSION}"
    # a new coordinator replaces the old line
    third = _run(["sh", script, "--coordinator=10.9.9.9:7001", "--no-service"], env)
    assert third.returncode == 0, third.stderr
    coordinators = [ln for ln in settings.read_text().splitlines()
                    if ln.startswith("FTIS_CLIENT_COORDINATOR=")]
    assert coordinators == ['FTIS_CLIENT_COORDINATOR="10.9.9.9:7001"']
    bad = _run(["sh", script, "--coordinator", "x; rm -rf ~"], env)
    assert bad.returncode != 0 and "HOST:PORT" in bad.stderr

    key = home / ".local/share/ftis/node_key.pem"
    key.write_text("not a real key")
    gone = _run(["sh", script, "--uninstall"], env)
    assert gone.returncode == 0, gone.stderr
    assert not prog.exists() and not link.exists() and not link.is_symlink()
    assert not unit.exists()
    assert key.is_file() and settings.is_file()  # the identity and settings are kept
    purge = _run(["sh", script, "--uninstall", "--purge"], env)
    assert purge.returncode == 0, purge.stderr
    assert not key.exists() and not settings.exists()
    print(f"install.sh: first install {first_s:.1f} s, re-run {second_s:.1f} s")


# -- Windows setup.exe ----------------------------------------------------------------------

def _setup_exe(built: Path) -> Path:
    exe = built / SETUP_EXE
    if not exe.is_file():
        pytest.skip("makensis not installed (Debian: apt-get install nsis)")
    return exe


def test_setup_exe_is_a_small_x64_pe_file(built: Path) -> None:
    data = _setup_exe(built).read_bytes()
    assert data[:2] == b"MZ"
    pe = struct.unpack_from("<I", data, 0x3C)[0]
    assert data[pe:pe + 4] == b"PE\0\0"
    assert struct.unpack_from("<H", data, pe + 4)[0] == 0x8664  # IMAGE_FILE_MACHINE_AMD64
    assert len(data) < 25e6  # uv.exe compressed, no Python, no torch


@pytest.mark.skipif(shutil.which("7z") is None, reason="7z not installed (p7zip-full)")
def test_setup_exe_payload_lists_uv_and_pins(built: Path, tmp_path: Path) -> None:
    exe = _setup_exe(built)
    listing = subprocess.run(["7z", "l", str(exe)], capture_output=True, text=True, check=True)
    names = {line.split()[-1] for line in listing.stdout.splitlines()
             if re.match(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d| {19}) [.D]", line)}
    assert {"uv.exe", "install.ps1", "ftis-launch.py", "versions.txt",
            "uninstall.exe"} <= names
    subprocess.run(["7z", "x", "-y", f"-o{tmp_path}", str(exe), "uv.exe", "versions.txt"],
                   capture_output=True, check=True)
    assert (tmp_path / "versions.txt").read_text().split() == [
        f"ftis-client={CLIENT_VERSION}", f"uv={PINS['UV_VERSION']}",
        f"python={PINS['PYTHON_VERSION']}", f"torch={PINS['TORCH_VERSION']}"]
    # uv.exe is the one from uv's own win_amd64 wheel of the pinned version
    with zipfile.ZipFile(build.uv_wheel(PINS["UV_VERSION"], "win_amd64")) as z:
        wheel_uv = z.read(f"uv-{PINS['UV_VERSION']}.data/scripts/uv.exe")
    assert (tmp_path / "uv.exe").read_bytes() == wheel_uv


def _wine() -> str | None:
    wine = shutil.which("wine") or shutil.which("wine64")
    if wine is None:
        return None
    return wine


@pytest.mark.skipif(_wine() is None,
                    reason="Wine not installed (Debian: apt-get install wine wine64; "
                           "make test-installers installs it as root)")
def test_setup_exe_silent_install_under_wine(built: Path, tmp_path: Path) -> None:
    """``setup.exe /S`` lays out the files, start-menu entries, settings, uninstall and
    HKCU Run entries; the uninstaller removes them and keeps the settings. /SKIPPACKAGES
    skips the uv step (no Windows Python or wheels here; Wine 8 also lacks
    bcryptprimitives.dll, which uv.exe imports)."""
    exe = _setup_exe(built)
    prefix = tmp_path / "prefix"
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "WINEPREFIX": str(prefix), "WINEDEBUG": "-all", "HOME": str(home),
           "USER": "ftis", "WINEDLLOVERRIDES": "mscoree,mshtml,winemenubuilder.exe=d"}
    env.pop("DISPLAY", None)

    def wine(*args: str) -> subprocess.CompletedProcess:
        result = subprocess.run([_wine(), *args], env=env, capture_output=True, text=True,
                                timeout=300)
        subprocess.run(["wineserver", "-w"], env=env, timeout=300)
        return result

    try:
        result = wine(str(exe), "/S", "/SKIPPACKAGES", "/AUTOSTART",
                      "/COORDINATOR=10.1.2.3:7000")
        users = prefix / "drive_c/users"
        if not users.is_dir():
            pytest.skip(f"Wine could not create a prefix here: {result.stderr[-500:]}")
        assert result.returncode == 0, result.stderr[-2000:]
        (user,) = [p for p in users.iterdir() if p.name not in ("Public",)]
        inst = user / "AppData/Local/Programs/FTIS Client"
        assert sorted(p.name for p in inst.iterdir()) == [
            "ftis-launch.py", "install.ps1", "uninstall.exe", "uv.exe", "versions.txt"]
        menu = user / "AppData/Roaming/Microsoft/Windows/Start Menu/Programs/FTIS Client"
        assert sorted(p.name for p in menu.iterdir()) == [
            "FTIS Client (background).lnk", "FTIS Client.lnk", "Stop FTIS Client.lnk",
            "Uninstall FTIS Client.lnk"]
        settings = user / "AppData/Local/ftis/ftis/client.env"
        assert 'FTIS_CLIENT_COORDINATOR="10.1.2.3:7000"' in settings.read_text().splitlines()
        reg = (prefix / "user.reg").read_text(errors="replace")
        uninst = "Software\\Microsoft\\Windows\\CurrentVersion\\Uninstall\\FTIS Client"
        assert "[" + uninst.replace("\\", "\\\\") + "]" in reg
        assert f'"DisplayVersion"="{CLIENT_VERSION}"' in reg
        assert re.search(r'"FTIS Client"=".*pythonw\.exe.*ftis-launch\.py', reg)

        win_dir = "C:\\users\\" + user.name + "\\AppData\\Local\\Programs\\FTIS Client"
        result = wine(str(inst / "uninstall.exe"), "/S", f"_?={win_dir}")
        assert result.returncode == 0, result.stderr[-2000:]
        assert not (inst / "uv.exe").exists() and not menu.exists()
        reg = (prefix / "user.reg").read_text(errors="replace")
        assert "Uninstall\\\\FTIS Client]" not in reg
        assert not re.search(r'"FTIS Client"=".*pythonw\.exe', reg)
        assert settings.is_file()  # kept for a reinstall
    finally:
        subprocess.run(["wineserver", "-k"], env=env, timeout=60, capture_output=True)
