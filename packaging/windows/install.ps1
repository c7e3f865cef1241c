# FTIS volunteer client: one-line installer for Windows (per user, no admin rights).
#
#   powershell -ExecutionPolicy Bypass -c "irm https://<release>/install.ps1 | iex"
#   & ([scriptblock]::Create((irm https://<release>/install.ps1))) -Coordinator HOST:PORT -Autostart
#   & ([scriptblock]::Create((irm https://<release>/install.ps1))) -Uninstall [-Purge]
#
# Same layout as ftis-client-<version>-windows-x64-setup.exe, which runs this script with
# -PackagesOnly: a pinned uv.exe fetches a managed CPython and ftis-client with the PyTorch
# build that suits the machine (uv --torch-backend auto) into
# %LOCALAPPDATA%\Programs\FTIS Client. The overrides are the environment variables of
# install.sh (docs/volunteers.md): FTIS_VERSION, FTIS_PACKAGE_SPEC, FTIS_FIND_LINKS,
# FTIS_PYTHON, FTIS_TORCH_BACKEND, FTIS_TORCH_VERSION, FTIS_UV, FTIS_UV_DOWNLOAD,
# FTIS_INSTALL_DIR, FTIS_COORDINATOR.
param(
    [string]$Coordinator = $env:FTIS_COORDINATOR,
    [string]$InstallDir = $(if ($env:FTIS_INSTALL_DIR) { $env:FTIS_INSTALL_DIR } else { Join-Path $env:LOCALAPPDATA 'Programs\FTIS Client' }),
    [switch]$Autostart,
    [switch]$PackagesOnly,
    [switch]$Uninstall,
    [switch]$Purge
)
$ErrorActionPreference = 'Stop'
Set-StrictMode -Version 3.0

# @@BEGIN PINS (packaging/versions; packaging/build.py rewrites this block)
$FtisInstallerVersion = '0.1.0'
$UvVersion = '0.13.9'
$PythonVersion = '3.11.18'
$TorchVersion = '2.13.0'
# @@END PINS

# @@BEGIN LAUNCHER (packaging/build.py inlines packaging/windows/ftis-launch.py here)
function Get-LauncherSource { Get-Content -Raw -Path (Join-Path $PSScriptRoot 'ftis-launch.py') }
# @@END LAUNCHER

function Say([string]$Message) { Write-Host "ftis-install: $Message" }

# platformdirs' folders of the client on Windows (appauthor = appname = ftis)
$DataDir = Join-Path $env:LOCALAPPDATA 'ftis\ftis'
$ConfigFile = Join-Path $DataDir 'client.env'
$CacheDir = Join-Path $DataDir 'Cache'
$Venv = Join-Path $InstallDir 'venv'
$Uv = Join-Path $InstallDir 'uv.exe'
$Launcher = Join-Path $InstallDir 'ftis-launch.py'
$StartMenu = Join-Path ([Environment]::GetFolderPath('Programs')) 'FTIS Client'
$RunKey = 'HKCU:\Software\Microsoft\Windows\CurrentVersion\Run'

function Invoke-Uv {
    & $Uv @args
    if ($LASTEXITCODE -ne 0) { throw "uv $($args[0]) failed with exit code $LASTEXITCODE" }
}

function Install-Uv {
    New-Item -ItemType Directory -Force -Path $InstallDir | Out-Null
    if ($env:FTIS_UV) {
        if ((Resolve-Path $env:FTIS_UV).Path -ne $Uv) { Copy-Item -Force $env:FTIS_UV $Uv }
    } elseif ((Test-Path $Uv) -and ((& $Uv --version) -split ' ')[1] -eq $UvVersion) {
        return
    } else {
        $base = if ($env:FTIS_UV_DOWNLOAD) { $env:FTIS_UV_DOWNLOAD } else { 'https://github.com/astral-sh/uv/releases/download' }
        $url = "$base/$UvVersion/uv-x86_64-pc-windows-msvc.zip"
        $tmp = Join-Path ([IO.Path]::GetTempPath()) ("ftis-uv-" + [guid]::NewGuid())
        New-Item -ItemType Directory -Path $tmp | Out-Null
        Say "downloading uv $UvVersion"
        [Net.ServicePointManager]::SecurityProtocol = [Net.SecurityProtocolType]::Tls12
        Invoke-WebRequest -UseBasicParsing -Uri $url -OutFile "$tmp\uv.zip"
        $want = ((Invoke-WebRequest -UseBasicParsing -Uri "$url.sha256").Content -split '\s+')[0]
        $got = (Get-FileHash -Algorithm SHA256 "$tmp\uv.zip").Hash
        if ($got -ne $want.ToUpper()) { throw "checksum mismatch for $url" }
        Expand-Archive -Force -Path "$tmp\uv.zip" -DestinationPath $tmp
        Copy-Item -Force "$tmp\uv.exe" $Uv
        Remove-Item -Recurse -Force $tmp
    }
}

function Install-Client {
    $env:UV_PYTHON_INSTALL_DIR = Join-Path $InstallDir 'python'
    if (-not $env:UV_CACHE_DIR) { $env:UV_CACHE_DIR = Join-Path $InstallDir 'cache' }
    $python = Join-Path $Venv 'Scripts\python.exe'
    $have = ''
    if (Test-Path $python) { $have = & $python -c 'import platform; print(platform.python_version())' }
    if ($env:FTIS_PYTHON) { $pyArgs = @('--python', $env:FTIS_PYTHON) }
    else { $pyArgs = @('--python', $PythonVersion, '--managed-python') }
    if (-not $have -or (-not $env:FTIS_PYTHON -and $have -ne $PythonVersion)) {
        Say "creating the environment (Python $($pyArgs[1]))"
        Invoke-Uv venv --quiet --clear @pyArgs $Venv
    }
    $version = if ($env:FTIS_VERSION) { $env:FTIS_VERSION } else { $FtisInstallerVersion }
    $spec = if ($env:FTIS_PACKAGE_SPEC) { $env:FTIS_PACKAGE_SPEC } else { "ftis-client[embedded]==$version" }
    $torch = if ($env:FTIS_TORCH_VERSION) { $env:FTIS_TORCH_VERSION } else { $TorchVersion }
    $backend = if ($env:FTIS_TORCH_BACKEND) { $env:FTIS_TORCH_BACKEND } else { 'auto' }
    $pipArgs = @('--python', $python, '--reinstall-package', 'ftis-client', '--reinstall-package', 'ftis-proto')
    if ($backend -ne 'none') { $pipArgs += @('--torch-backend', $backend) }
    if ($env:FTIS_FIND_LINKS) { $pipArgs += @('--find-links', $env:FTIS_FIND_LINKS) }
    $pipArgs += ($spec -split '\s+' | Where-Object { $_ })
    $pipArgs += "torch==$torch"
    Say "installing $spec with torch $torch (torch backend $backend)"
    Invoke-Uv pip install @pipArgs
    if (-not (Test-Path (Join-Path $Venv 'Scripts\ftis-client.exe'))) { throw "ftis-client was not installed into $Venv" }
}

function Write-Config {
    New-Item -ItemType Directory -Force -Path (Join-Path $DataDir 'node') | Out-Null
    if (-not (Test-Path $ConfigFile)) {
        $c = if ($Coordinator) { $Coordinator } else { '127.0.0.1:7000' }
        @(
            '# Settings of the FTIS background client: FTIS_CLIENT_<FLAG> = the flags of',
            '# `ftis-client start`. Written by the installer; kept on update and uninstall.',
            "FTIS_CLIENT_COORDINATOR=`"$c`"",
            'FTIS_CLIENT_ROUNDS=0',
            "FTIS_CLIENT_OUT=`"$(Join-Path $DataDir 'node')`""
        ) | Set-Content -Encoding ASCII -Path $ConfigFile
    } elseif ($Coordinator) {
        $lines = @(Get-Content $ConfigFile | Where-Object { $_ -notmatch '^FTIS_CLIENT_COORDINATOR=' })
        ($lines + "FTIS_CLIENT_COORDINATOR=`"$Coordinator`"") | Set-Content -Encoding ASCII -Path $ConfigFile
    }
}

function Install-Shortcuts {
    (Get-LauncherSource) | Set-Content -Encoding UTF8 -Path $Launcher
    New-Item -ItemType Directory -Force -Path $StartMenu | Out-Null
    $shell = New-Object -ComObject WScript.Shell
    $scripts = Join-Path $Venv 'Scripts'
    foreach ($s in @(
        @('FTIS Client', 'python.exe', "`"$Launcher`" --console"),
        @('FTIS Client (background)', 'pythonw.exe', "`"$Launcher`""),
        @('Stop FTIS Client', 'pythonw.exe', "`"$Launcher`" --stop"))) {
        $lnk = $shell.CreateShortcut((Join-Path $StartMenu "$($s[0]).lnk"))
        $lnk.TargetPath = Join-Path $scripts $s[1]
        $lnk.Arguments = $s[2]
        $lnk.WorkingDirectory = $InstallDir
        $lnk.Save()
    }
    if ($Autostart) {
        New-Item -Force -Path $RunKey -ErrorAction SilentlyContinue | Out-Null
        Set-ItemProperty -Path $RunKey -Name 'FTIS Client' -Value "`"$(Join-Path $scripts 'pythonw.exe')`" `"$Launcher`""
        Say 'starts at login (HKCU Run)'
    }
}

function Uninstall-Client {
    $pythonw = Join-Path $Venv 'Scripts\pythonw.exe'
    if ((Test-Path $pythonw) -and (Test-Path $Launcher)) { & $pythonw $Launcher --stop | Out-Null }
    Remove-ItemProperty -Path $RunKey -Name 'FTIS Client' -ErrorAction SilentlyContinue
    Remove-Item -Recurse -Force -ErrorAction SilentlyContinue $StartMenu, $InstallDir
    Say "removed $InstallDir, the start-menu entries and start at login"
    if ($Purge) {
        Remove-Item -Recurse -Force -ErrorAction SilentlyContinue $DataDir
        Say 'removed the node key, checkpoints, settings and models (-Purge)'
    } else {
        Say "kept the node key, checkpoints and settings in $DataDir (-Uninstall -Purge removes them)"
    }
}

if ($Uninstall) { Uninstall-Client; return }
Say "installing ftis-client into $InstallDir"
Install-Uv
Install-Client
if (-not $PackagesOnly) {
    Write-Config
    Install-Shortcuts
}
Say "installed: $(& (Join-Path $Venv 'Scripts\ftis-client.exe') --version)"
