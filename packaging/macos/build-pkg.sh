#!/bin/sh
# Build ftis-client-<version>-macos-<arch>.pkg (macOS only: pkgbuild, productbuild).
#
#   sh packaging/macos/build-pkg.sh [OUTDIR] [ARCH]    (ARCH: arm64 | x86_64, default: this Mac)
#
# The package puts a pinned uv and the install.sh built by packaging/build.py into
# /Library/Application Support/FTIS Client; its postinstall script runs that install.sh as
# the logged-in user, which lets uv fetch CPython and ftis-client (PyTorch for macOS:
# MPS/CPU) into ~/Library/Application Support/ftis-client and writes the LaunchAgent
# ~/Library/LaunchAgents/org.ftis.client.plist. Built by .github/workflows/installers.yml.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${1:-$root/dist/installers}
arch=${2:-$(uname -m)}
python=${PYTHON:-python3}

case "$arch" in
    arm64) wheel_platform=macosx_11_0_arm64 ;;
    x86_64) wheel_platform=macosx_10_12_x86_64 ;;
    *) echo "build-pkg.sh: unknown arch $arch" >&2; exit 2 ;;
esac
uv_version=$(sed -n 's/^UV_VERSION=//p' "$here/../versions")
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$root/client/pyproject.toml" | head -n 1)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
payload="$work/root/Library/Application Support/FTIS Client"
mkdir -p "$payload" "$out"

# install.sh (pins and templates inlined) and versions.txt
"$python" "$root/packaging/build.py" --targets sh --out "$work/built"
cp "$work/built/install.sh" "$work/built/versions.txt" "$payload/"

# uv from its own macOS wheel on PyPI
"$python" -m pip download --quiet --disable-pip-version-check "uv==$uv_version" \
    --only-binary=:all: --platform "$wheel_platform" --no-deps -d "$work/wheel"
(cd "$work/wheel" && unzip -q -j ./uv-*.whl "uv-$uv_version.data/scripts/uv" -d "$payload")
chmod 755 "$payload/uv" "$payload/install.sh"

cp "$here/scripts/postinstall" "$work/postinstall"
mkdir -p "$work/scripts"
mv "$work/postinstall" "$work/scripts/postinstall"
chmod 755 "$work/scripts/postinstall"

pkgbuild --root "$work/root" --scripts "$work/scripts" --identifier org.ftis.client \
    --version "$version" --install-location / "$work/component.pkg"
pkg="$out/ftis-client-$version-macos-$arch.pkg"
productbuild --identifier org.ftis.client --version "$version" \
    --package "$work/component.pkg" "$pkg"
echo "built $pkg"
