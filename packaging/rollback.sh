#!/bin/bash
# `make rollback`: back to the release installed before the current one (kept by make install), with
# its agent bundle. The SPANK plugin is shared by all releases and stays the newest: it accepts
# every plugstack.conf argument an older release renders. Restart the daemons afterwards.
set -euo pipefail

: "${PREFIX:?}"
die() { echo "make rollback: $*" >&2; exit 1; }
cur=$(readlink "$PREFIX/current" 2>/dev/null) || die "$PREFIX holds no slurm-antman install"
cur=${cur#releases/}
prev=$(ls -1t "$PREFIX/releases" | grep -vx "$cur" | head -n 1 || true)
[[ -n $prev && -e $PREFIX/releases/$prev/.complete ]] || die "no earlier release in $PREFIX/releases to go back to"
ln -sfn "releases/$prev" "$PREFIX/current.new" && mv -Tf "$PREFIX/current.new" "$PREFIX/current"
"$PREFIX/bin/antman" agent-bundle --out "$PREFIX/agent"
# The one we left becomes the older: a second rollback returns to it.
touch -h "$PREFIX/releases/$prev"
echo "rolled back from $cur to $prev; restart the daemons: systemctl restart antman-sidecar / antman-coordinator"
