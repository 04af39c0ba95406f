#!/bin/bash
# `make install`: slurm-antman into its own prefix, beside (never over) the site's configuration.
#
#   PREFIX/releases/ID/venv   this release's virtual environment (its own Python packages: Debian's
#                             system Python refuses pip, PEP 668, and the site's Python stays untouched)
#   PREFIX/current            -> releases/ID: switched with one rename, so an upgrade is atomic and the
#                             previous release stays for `make rollback`
#   PREFIX/bin/antman         -> current/venv/bin/antman (what the units, the Prolog and the users run)
#   PREFIX/agent              the agent bundle (antman.yaml agent_path), swapped in whole
#   PREFIX/share/slurm-antman the Lua scripts, the example antman.yaml, the Grafana dashboard
#   PREFIX/share/doc/slurm-antman  the guides
# and outside PREFIX, each recorded in PREFIX/share/slurm-antman/installed-files for `make uninstall`:
#   BINDIR/antman (a link), PLUGIN_DIR/antman_spank.so, UNIT_DIR/antman-{sidecar,coordinator}.service
#
# Nothing in /etc is written: antman.yaml, the keys, slurm.conf and the site's own Lua scripts are the
# admin's (docs/admin.md says how to wire them). Running daemons keep running the release they
# started with until they are restarted; running jobs keep the plugin they loaded (it is replaced by
# rename, never rewritten in place).
set -euo pipefail

: "${PREFIX:?}" "${BINDIR:?}" "${PLUGIN_DIR:?}" "${UNIT_DIR:?}" "${INSTALL_PYTHON:?}"
SRC=$(cd "$(dirname "$0")/.." && pwd)
AGENT_PYTHONS=${AGENT_PYTHONS:-}
KEEP_RELEASES=${KEEP_RELEASES:-2}

die() { echo "make install: $*" >&2; exit 1; }
[[ $PREFIX = /* && $BINDIR = /* && $PLUGIN_DIR = /* && $UNIT_DIR = /* ]] ||
    die "PREFIX, BINDIR, PLUGIN_DIR and UNIT_DIR must be absolute paths"
[[ "$PREFIX$BINDIR$PLUGIN_DIR$UNIT_DIR" != *[[:space:]]* ]] || die "install paths must not contain white space"
[[ $PREFIX != / && $PREFIX != /usr && $PREFIX != /usr/local ]] ||
    die "PREFIX=$PREFIX: slurm-antman needs a prefix of its own (default /opt/slurm-antman); uninstall removes it whole"
"$INSTALL_PYTHON" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 10))' 2>/dev/null ||
    die "$INSTALL_PYTHON: need Python 3.10 or later with venv (Debian: apt-get install python3-venv)"
if [[ -e $PREFIX && ! -e $PREFIX/share/slurm-antman/installed-files ]] && [[ -n $(ls -A "$PREFIX") ]]; then
    die "$PREFIX exists and holds no slurm-antman install: refusing to install into it"
fi

version=$("$INSTALL_PYTHON" -c 'import re,sys; print(re.search(r"^version = \"([^\"]+)\"", open(sys.argv[1]).read(), re.M).group(1))' "$SRC/pyproject.toml")
commit=$(git -C "$SRC" rev-parse --short=10 HEAD 2>/dev/null || echo nogit)
if [[ $commit != nogit ]] && [[ -n $(git -C "$SRC" status --porcelain --untracked-files=no 2>/dev/null) ]]; then
    commit="$commit-modified"
fi
id="$version-$commit-$(date -u +%Y%m%dT%H%M%SZ)"

# Directories this install creates outside PREFIX (PREFIX's parents too), for uninstall to remove when
# empty; an upgrade keeps the first install's record.
made=()
if [[ -f $PREFIX/share/slurm-antman/installed-files ]]; then
    mapfile -t made < <(awk '$1 == "dir" {print $2}' "$PREFIX/share/slurm-antman/installed-files")
fi
for d in "$(dirname "$PREFIX")" "$BINDIR" "$PLUGIN_DIR" "$UNIT_DIR"; do
    new=()
    while [[ ! -e $d ]]; do new+=("$d"); d=$(dirname "$d"); done
    made+=("${new[@]}")
done
rel=$PREFIX/releases/$id
mkdir -p "$PREFIX/releases" "$PREFIX/bin" "$PREFIX/share/slurm-antman" "$PREFIX/share/doc/slurm-antman"
chmod 0755 "$PREFIX" "$PREFIX/releases"
stage=$(mktemp -d)
# A release directory is complete once it holds .complete; a failed install leaves none behind.
trap 'rm -rf "$stage"; [[ -e $rel/.complete ]] || rm -rf "$rel"' EXIT

echo "== $id: virtual environment"
"$INSTALL_PYTHON" -m venv "$rel/venv"
# Built from a copy: pip's in-tree build would leave build/ and *.egg-info in the checkout.
tar -C "$SRC" --exclude=./.venv --exclude='./.venv-*' --exclude=./.git --exclude='*/__pycache__' --exclude='./build' \
    --exclude='*.egg-info' --exclude='./spank/*.o' --exclude='./spank/*.so' -cf - . | tar -C "$stage" -xf -
"$rel/venv/bin/python" -m pip install -q --disable-pip-version-check "$stage[nvml]"
"$rel/venv/bin/antman" --help >/dev/null || die "the new release's antman does not run"
touch "$rel/.complete"

echo "== SPANK plugin -> $PLUGIN_DIR/antman_spank.so"
make -s -C "$SRC/spank" BUILDDIR="$stage/spank-build"
mkdir -p "$PLUGIN_DIR"
# Rename over the old file: slurmstepds of running jobs have it mapped, and rewriting it in place
# would crash them.
install -m 0755 "$stage/spank-build/antman_spank.so" "$PLUGIN_DIR/.antman_spank.so.new"
mv -f "$PLUGIN_DIR/.antman_spank.so.new" "$PLUGIN_DIR/antman_spank.so"

echo "== shared files, docs"
share=$PREFIX/share/slurm-antman
rm -rf "$share/lua.new" && mkdir -p "$share/lua.new/examples" && install -m 0644 "$SRC"/etc/*.lua "$share/lua.new/"
install -m 0644 "$SRC"/etc/examples/*.lua "$share/lua.new/examples/"  # a site's own scripts calling the modules
rm -rf "$share/lua" && mv "$share/lua.new" "$share/lua"
install -m 0644 "$SRC/etc/antman.yaml" "$share/antman.yaml.example"
rm -rf "$share/grafana" && cp -r "$SRC/etc/grafana" "$share/grafana"
doc=$PREFIX/share/doc/slurm-antman
rm -rf "$doc" && mkdir -p "$doc" && cp "$SRC"/docs/*.md "$SRC/README.md" "$doc/"
if [[ -d $SRC/docs/img ]]; then cp -r "$SRC/docs/img" "$doc/"; fi

echo "== systemd units -> $UNIT_DIR"
mkdir -p "$UNIT_DIR"
for u in antman-sidecar.service antman-coordinator.service; do
    sed -e "s|/opt/slurm-antman|$PREFIX|g" "$SRC/etc/systemd/$u" > "$UNIT_DIR/.$u.new"
    chmod 0644 "$UNIT_DIR/.$u.new" && mv -f "$UNIT_DIR/.$u.new" "$UNIT_DIR/$u"
done

echo "== switch to $id"
ln -sfn "releases/$id" "$PREFIX/current.new" && mv -Tf "$PREFIX/current.new" "$PREFIX/current"
ln -sfn ../current/venv/bin/antman "$PREFIX/bin/antman"
mkdir -p "$BINDIR"
if [[ -e $BINDIR/antman || -L $BINDIR/antman ]] && [[ $(readlink "$BINDIR/antman") != "$PREFIX/bin/antman" ]]; then
    echo "make install: $BINDIR/antman exists and is not this install's link: left alone; run $PREFIX/bin/antman" >&2
else
    ln -sfn "$PREFIX/bin/antman" "$BINDIR/antman"
fi

echo "== agent bundle -> $PREFIX/agent"
py_args=()
for v in $AGENT_PYTHONS; do py_args+=(--python "$v"); done
"$PREFIX/bin/antman" agent-bundle --out "$PREFIX/agent" "${py_args[@]}"

# What lies outside PREFIX, for uninstall; with the plugin's checksum, so that uninstall leaves a
# plugin someone else has replaced since.
{
    echo "# slurm-antman $id: files outside $PREFIX (make uninstall removes them, then $PREFIX)"
    [[ $(readlink "$BINDIR/antman" 2>/dev/null) == "$PREFIX/bin/antman" ]] && echo "link $BINDIR/antman"
    echo "file $PLUGIN_DIR/antman_spank.so $(sha256sum "$PLUGIN_DIR/antman_spank.so" | cut -d' ' -f1)"
    for u in antman-sidecar.service antman-coordinator.service; do
        echo "file $UNIT_DIR/$u $(sha256sum "$UNIT_DIR/$u" | cut -d' ' -f1)"
    done
    for d in "${made[@]}"; do echo "dir $d"; done
} > "$share/installed-files"
printf '{"release": "%s", "version": "%s", "commit": "%s", "plugin": "%s", "agent": "%s", "bin": "%s"}\n' \
    "$id" "$version" "$commit" "$PLUGIN_DIR/antman_spank.so" "$PREFIX/agent" "$PREFIX/bin/antman" \
    > "$share/install.json"

# Old releases beyond the current and the previous one (the rollback target).
mapfile -t old < <(ls -1t "$PREFIX/releases" | grep -vx "$id" | tail -n +"$KEEP_RELEASES")
for r in "${old[@]}"; do rm -rf "${PREFIX:?}/releases/$r"; done

if [[ -d /run/systemd/system ]]; then systemctl daemon-reload || true; fi
cat <<EOF
== installed slurm-antman $version ($commit) in $PREFIX
   restart the daemons to run it: systemctl restart antman-sidecar (nodes), antman-coordinator (controller)
   Lua scripts to copy beside slurm.conf: $share/lua; check a host with: antman doctor
EOF
