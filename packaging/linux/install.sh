#!/bin/sh
# FTIS volunteer client: installer for Linux and macOS (POSIX sh, no root needed).
#
#   curl -LsSf https://<release>/install.sh | sh -s -- --coordinator HOST:PORT --autostart
#   sh install.sh [--coordinator HOST:PORT] [--autostart] [--no-service]
#   sh install.sh --uninstall [--purge]
#
# It copies a pinned uv, lets uv fetch a managed CPython and install ftis-client with the
# PyTorch build that suits the machine (uv --torch-backend auto: CUDA where an NVIDIA
# driver is found, CPU otherwise) into one folder, links `ftis-client` into ~/.local/bin
# and writes a background service (systemd --user unit on Linux, LaunchAgent on macOS).
# Running it again updates in place; nothing outside the folders below is touched.
#
# Overrides (environment variables; docs/volunteers.md):
#   FTIS_VERSION        ftis-client version to install (default: this installer's)
#   FTIS_PACKAGE_SPEC   what uv installs instead of ftis-client[embedded]==VERSION, one or
#                       more requirements, wheel files or source folders (space-separated)
#   FTIS_FIND_LINKS     a folder (or URL) of wheels uv also searches (uv --find-links)
#   FTIS_PYTHON         a Python to use (path or version) instead of uv's managed CPython
#   FTIS_TORCH_BACKEND  uv --torch-backend (default auto; cpu, cu128, ...; none = plain index)
#   FTIS_TORCH_VERSION  torch version (default: pinned below)
#   FTIS_UV             an existing uv binary to copy instead of downloading uv
#   FTIS_UV_DOWNLOAD    base URL of uv release archives (default: GitHub releases)
#   FTIS_INSTALL_DIR    program folder (default ~/.local/share/ftis-client,
#                       macOS ~/Library/Application Support/ftis-client)
#   FTIS_BIN_DIR        where the ftis-client link goes (default ~/.local/bin)
#   FTIS_COORDINATOR    same as --coordinator
#   FTIS_NO_SERVICE=1   same as --no-service
# uv's own variables (UV_CACHE_DIR, UV_INDEX, UV_NATIVE_TLS, ...) pass through to uv.
set -eu

# @@BEGIN PINS (packaging/versions; packaging/build.py rewrites this block)
FTIS_INSTALLER_VERSION=0.1.0
UV_VERSION=0.13.9
PYTHON_VERSION=3.11.18
TORCH_VERSION=2.13.0
# @@END PINS

# @@BEGIN TEMPLATES (packaging/build.py inlines the template files here)
systemd_unit_template() {
    cat "$(cd "$(dirname "$0")" && pwd)/ftis-client.service.in"
}
launch_agent_template() {
    cat "$(cd "$(dirname "$0")" && pwd)/../macos/org.ftis.client.plist.in"
}
# @@END TEMPLATES

say() { printf 'ftis-install: %s\n' "$*"; }
die() { printf 'ftis-install: error: %s\n' "$*" >&2; exit 1; }

usage() {
    sed -n '2,31p' "$0" 2>/dev/null | sed 's/^# \{0,1\}//' || true
    echo "options: --coordinator HOST:PORT  --autostart  --no-service  --uninstall  --purge  --help"
}

# Escape a value for the replacement side of `sed s|...|...|`.
sed_escape() { printf '%s' "$1" | sed 's/[\\|&]/\\&/g'; }

# Single-quote a value for a generated sh script.
sh_quote() { printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\\\\''/g")"; }

fill_template() {
    sed -e "s|@SERVICE_WRAPPER@|$(sed_escape "$SERVICE_WRAPPER")|g" \
        -e "s|@CONFIG_FILE@|$(sed_escape "$CONFIG_FILE")|g" \
        -e "s|@LOG_FILE@|$(sed_escape "$LOG_FILE")|g" \
        -e "s|@RUN_AT_LOAD@|$RUN_AT_LOAD|g"
}

set_paths() {
    [ -n "${HOME:-}" ] || die "HOME is not set"
    OS=$(uname -s)
    case "$OS" in
        Linux)
            data_home=${XDG_DATA_HOME:-$HOME/.local/share}
            INSTALL_DIR=${FTIS_INSTALL_DIR:-$data_home/ftis-client}
            # platformdirs' folders of the client (key, checkpoints, settings, models)
            DATA_DIR=$data_home/ftis
            CONFIG_DIR=${XDG_CONFIG_HOME:-$HOME/.config}/ftis
            CACHE_DIR=${XDG_CACHE_HOME:-$HOME/.cache}/ftis
            LOG_FILE="(journald: journalctl --user -u ftis-client)"
            SERVICE_FILE=${XDG_CONFIG_HOME:-$HOME/.config}/systemd/user/ftis-client.service
            ;;
        Darwin)
            INSTALL_DIR=${FTIS_INSTALL_DIR:-$HOME/Library/Application Support/ftis-client}
            DATA_DIR=$HOME/Library/Application\ Support/ftis
            CONFIG_DIR=$DATA_DIR
            CACHE_DIR=$HOME/Library/Caches/ftis
            LOG_FILE=$HOME/Library/Logs/ftis-client.log
            SERVICE_FILE=$HOME/Library/LaunchAgents/org.ftis.client.plist
            ;;
        *) die "unsupported system $OS (Windows: use setup.exe or install.ps1)" ;;
    esac
    BIN_DIR=${FTIS_BIN_DIR:-$HOME/.local/bin}
    UV=$INSTALL_DIR/bin/uv
    VENV=$INSTALL_DIR/venv
    SERVICE_WRAPPER=$INSTALL_DIR/bin/ftis-client-service
    CONFIG_FILE=$CONFIG_DIR/client.env
    NODE_DIR=$DATA_DIR/node
}

download() {  # URL FILE
    if command -v curl >/dev/null 2>&1; then
        curl --proto '=https' --tlsv1.2 -fsSL "$1" -o "$2"
    elif command -v wget >/dev/null 2>&1; then
        wget -q -O "$2" "$1"
    else
        die "need curl or wget to download uv (or set FTIS_UV to a uv binary)"
    fi
}

sha256_of() {
    if command -v sha256sum >/dev/null 2>&1; then sha256sum "$1" | cut -d' ' -f1
    else shasum -a 256 "$1" | cut -d' ' -f1; fi
}

uv_target() {
    arch=$(uname -m)
    case "$OS-$arch" in
        Linux-x86_64|Linux-amd64) echo x86_64-unknown-linux-gnu ;;
        Linux-aarch64|Linux-arm64) echo aarch64-unknown-linux-gnu ;;
        Darwin-x86_64) echo x86_64-apple-darwin ;;
        Darwin-arm64|Darwin-aarch64) echo aarch64-apple-darwin ;;
        *) die "no uv build for $OS $arch" ;;
    esac
}

install_uv() {
    mkdir -p "$INSTALL_DIR/bin"
    if [ -n "${FTIS_UV:-}" ]; then
        [ -x "$FTIS_UV" ] || die "FTIS_UV=$FTIS_UV is not an executable"
        if [ "$(cd "$(dirname "$FTIS_UV")" && pwd)/$(basename "$FTIS_UV")" != "$UV" ]; then
            cp "$FTIS_UV" "$UV.tmp" && mv -f "$UV.tmp" "$UV"
        fi
    elif [ -x "$UV" ] && [ "$("$UV" --version 2>/dev/null | cut -d' ' -f2)" = "$UV_VERSION" ]; then
        :
    else
        target=$(uv_target)
        base=${FTIS_UV_DOWNLOAD:-https://github.com/astral-sh/uv/releases/download}
        url=$base/$UV_VERSION/uv-$target.tar.gz
        tmp=$(mktemp -d)
        say "downloading uv $UV_VERSION ($target)"
        download "$url" "$tmp/uv.tar.gz"
        download "$url.sha256" "$tmp/uv.tar.gz.sha256"
        want=$(cut -d' ' -f1 <"$tmp/uv.tar.gz.sha256")
        [ "$(sha256_of "$tmp/uv.tar.gz")" = "$want" ] || die "checksum mismatch for $url"
        tar -xzf "$tmp/uv.tar.gz" -C "$tmp"
        cp "$tmp/uv-$target/uv" "$UV.tmp" && mv -f "$UV.tmp" "$UV"
        rm -rf "$tmp"
    fi
    chmod 755 "$UV"
    got=$("$UV" --version | cut -d' ' -f2)
    [ "$got" = "$UV_VERSION" ] || say "note: uv $got, not the pinned $UV_VERSION"
}

install_python_and_client() {
    # uv keeps its managed CPython and (unless UV_CACHE_DIR is set) its cache in the
    # program folder, so --uninstall removes them too.
    UV_PYTHON_INSTALL_DIR=$INSTALL_DIR/python
    UV_CACHE_DIR=${UV_CACHE_DIR:-$INSTALL_DIR/cache}
    export UV_PYTHON_INSTALL_DIR UV_CACHE_DIR
    if [ -n "${FTIS_PYTHON:-}" ]; then
        python=$FTIS_PYTHON
        set -- --python "$python"
    else
        python=$PYTHON_VERSION
        set -- --python "$python" --managed-python
    fi
    have=""
    if [ -x "$VENV/bin/python" ]; then
        have=$("$VENV/bin/python" -c 'import platform; print(platform.python_version())' \
            2>/dev/null || true)
    fi
    if [ -z "$have" ] || { [ -z "${FTIS_PYTHON:-}" ] && [ "$have" != "$PYTHON_VERSION" ]; }; then
        say "creating the environment (Python $python)"
        "$UV" venv --quiet --clear "$@" "$VENV"
    fi

    version=${FTIS_VERSION:-$FTIS_INSTALLER_VERSION}
    spec=${FTIS_PACKAGE_SPEC:-ftis-client[embedded]==$version}
    backend=${FTIS_TORCH_BACKEND:-auto}
    set -- --python "$VENV/bin/python" --reinstall-package ftis-client \
        --reinstall-package ftis-proto
    [ "$backend" = none ] || set -- "$@" --torch-backend "$backend"
    [ -z "${FTIS_FIND_LINKS:-}" ] || set -- "$@" --find-links "$FTIS_FIND_LINKS"
    set -f  # split the spec on spaces, without globbing
    # shellcheck disable=SC2086
    set -- "$@" $spec "torch==${FTIS_TORCH_VERSION:-$TORCH_VERSION}"
    set +f
    say "installing $spec with torch ${FTIS_TORCH_VERSION:-$TORCH_VERSION} (torch backend $backend)"
    "$UV" pip install "$@"
    [ -x "$VENV/bin/ftis-client" ] || die "ftis-client was not installed into $VENV"
}

write_config() {
    mkdir -p "$CONFIG_DIR" "$NODE_DIR"
    coordinator=${COORDINATOR:-}
    if [ ! -f "$CONFIG_FILE" ]; then
        {
            echo "# Settings of the FTIS background service: FTIS_CLIENT_<FLAG> = the"
            echo "# flags of \`ftis-client start\` (ftis-client start --help). Restart the"
            echo "# service after editing. Written by install.sh; kept on update and uninstall."
            echo "FTIS_CLIENT_COORDINATOR=\"${coordinator:-127.0.0.1:7000}\""
            echo "FTIS_CLIENT_ROUNDS=0"
            echo "FTIS_CLIENT_OUT=\"$NODE_DIR\""
        } >"$CONFIG_FILE"
    elif [ -n "$coordinator" ]; then
        grep -v '^FTIS_CLIENT_COORDINATOR=' "$CONFIG_FILE" >"$CONFIG_FILE.tmp" || true
        echo "FTIS_CLIENT_COORDINATOR=\"$coordinator\"" >>"$CONFIG_FILE.tmp"
        mv -f "$CONFIG_FILE.tmp" "$CONFIG_FILE"
    fi
    if [ -z "$coordinator" ] && grep -q '^FTIS_CLIENT_COORDINATOR="127.0.0.1:7000"' "$CONFIG_FILE"; then
        say "no coordinator set: run again with --coordinator HOST:PORT (or edit $CONFIG_FILE)"
    fi
}

write_wrapper() {
    {
        echo "#!/bin/sh"
        echo "# Runs \`ftis-client start\` with the settings in client.env (install.sh)."
        echo "set -eu"
        echo "set -a"
        echo ". $(sh_quote "$CONFIG_FILE")"
        echo "set +a"
        echo "exec $(sh_quote "$VENV/bin/ftis-client") start \"\$@\""
    } >"$SERVICE_WRAPPER.tmp"
    chmod 755 "$SERVICE_WRAPPER.tmp"
    mv -f "$SERVICE_WRAPPER.tmp" "$SERVICE_WRAPPER"
}

link_cli() {
    mkdir -p "$BIN_DIR"
    ln -sf "$VENV/bin/ftis-client" "$BIN_DIR/ftis-client"
    case ":$PATH:" in
        *":$BIN_DIR:"*) ;;
        *) say "add $BIN_DIR to your PATH to run ftis-client (or run $BIN_DIR/ftis-client)" ;;
    esac
}

have_systemd_user() {
    command -v systemctl >/dev/null 2>&1 && systemctl --user show-environment >/dev/null 2>&1
}

install_service() {
    mkdir -p "$(dirname "$SERVICE_FILE")"
    if [ "$OS" = Linux ]; then
        RUN_AT_LOAD=false
        systemd_unit_template | fill_template >"$SERVICE_FILE"
        if have_systemd_user; then
            systemctl --user daemon-reload
            if [ "$AUTOSTART" = 1 ]; then
                systemctl --user enable --now ftis-client.service
                say "service enabled: starts at login (systemctl --user status ftis-client)"
            elif systemctl --user --quiet is-active ftis-client.service; then
                systemctl --user restart ftis-client.service
                say "service restarted with the new version"
            else
                say "service installed: systemctl --user enable --now ftis-client"
            fi
        else
            say "service file $SERVICE_FILE written; no systemd user session here to enable it"
        fi
    else
        if [ "$AUTOSTART" = 1 ]; then RUN_AT_LOAD=true; else RUN_AT_LOAD=false; fi
        mkdir -p "$(dirname "$LOG_FILE")"
        launch_agent_template | fill_template >"$SERVICE_FILE"
        domain=gui/$(id -u)
        launchctl bootout "$domain/org.ftis.client" >/dev/null 2>&1 || true
        if [ "$AUTOSTART" = 1 ]; then
            launchctl bootstrap "$domain" "$SERVICE_FILE" || say "launchctl bootstrap failed"
            say "LaunchAgent loaded: runs now and at login (log: $LOG_FILE)"
        else
            say "LaunchAgent written: launchctl bootstrap $domain \"$SERVICE_FILE\""
        fi
    fi
}

do_install() {
    say "installing ftis-client ${FTIS_VERSION:-$FTIS_INSTALLER_VERSION} into $INSTALL_DIR"
    install_uv
    install_python_and_client
    write_config
    write_wrapper
    link_cli
    if [ "$NO_SERVICE" = 1 ]; then
        say "no background service (--no-service)"
    else
        install_service
    fi
    say "installed: $("$VENV/bin/ftis-client" --version)"
    say "settings: $CONFIG_FILE; node key and checkpoints: $DATA_DIR"
}

do_uninstall() {
    if [ "$OS" = Linux ]; then
        if have_systemd_user; then
            systemctl --user disable --now ftis-client.service >/dev/null 2>&1 || true
        fi
        rm -f "$SERVICE_FILE"
        if have_systemd_user; then systemctl --user daemon-reload || true; fi
    else
        launchctl bootout "gui/$(id -u)/org.ftis.client" >/dev/null 2>&1 || true
        rm -f "$SERVICE_FILE"
    fi
    if [ -L "$BIN_DIR/ftis-client" ]; then
        case "$(readlink "$BIN_DIR/ftis-client")" in
            "$INSTALL_DIR"/*) rm -f "$BIN_DIR/ftis-client" ;;
        esac
    fi
    rm -rf "$INSTALL_DIR"
    say "removed $INSTALL_DIR and the background service"
    if [ "$PURGE" = 1 ]; then
        rm -rf "$DATA_DIR" "$CONFIG_DIR" "$CACHE_DIR"
        say "removed the node key, checkpoints, settings and models (--purge)"
    else
        say "kept the node key, checkpoints and settings in $DATA_DIR and $CONFIG_DIR" \
            "(--uninstall --purge removes them)"
    fi
}

main() {
    ACTION=install AUTOSTART=0 PURGE=0
    NO_SERVICE=${FTIS_NO_SERVICE:-0}
    COORDINATOR=${FTIS_COORDINATOR:-}
    while [ $# -gt 0 ]; do
        case "$1" in
            --coordinator) [ $# -ge 2 ] || die "--coordinator needs HOST:PORT"
                COORDINATOR=$2; shift ;;
            --coordinator=*) COORDINATOR=${1#*=} ;;
            --autostart) AUTOSTART=1 ;;
            --no-service) NO_SERVICE=1 ;;
            --uninstall) ACTION=uninstall ;;
            --purge) PURGE=1 ;;
            -h|--help) usage; exit 0 ;;
            *) die "unknown option $1 (--help)" ;;
        esac
        shift
    done
    case "$COORDINATOR" in
        *[!A-Za-z0-9.:_\[\]-]*) die "--coordinator takes HOST:PORT, not $COORDINATOR" ;;
    esac
    set_paths
    if [ "$ACTION" = uninstall ]; then do_uninstall; else do_install; fi
}

main "$@"
