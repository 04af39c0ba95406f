#!/bin/bash
# `make uninstall`: removes what `make install` put outside PREFIX (as recorded in
# PREFIX/share/slurm-antman/installed-files), then PREFIX itself. A file someone changed since the
# install (a plugin rebuilt by hand, an edited unit) is left, and named. What the admin made is left
# and named too: antman.yaml, the keys, the state and log directories, the lines in slurm.conf and
# plugstack.conf, the Lua scripts copied beside slurm.conf (docs/admin.md, "Removal", says how).
set -euo pipefail

: "${PREFIX:?}"
list=$PREFIX/share/slurm-antman/installed-files
die() { echo "make uninstall: $*" >&2; exit 1; }
[[ $PREFIX = /* && $PREFIX != / ]] || die "PREFIX must be an absolute path other than /"
[[ -f $list ]] || die "$PREFIX holds no slurm-antman install (no $list)"

kept=()
while read -r kind path sum; do
    [[ $kind = \#* || -z $kind ]] && continue
    case $kind in
    link)
        if [[ -L $path && $(readlink "$path") == "$PREFIX/bin/antman" ]]; then rm -f "$path"
        elif [[ -e $path || -L $path ]]; then kept+=("$path (no longer this install's link)"); fi ;;
    file)
        if [[ ! -e $path ]]; then :
        elif [[ $(sha256sum "$path" | cut -d' ' -f1) == "$sum" ]]; then rm -f "$path"
        else kept+=("$path (changed since the install)"); fi ;;
    dir) ;;  # after the files, below
    *) die "$list: unknown entry '$kind'" ;;
    esac
done < "$list"
# The directories install created, deepest first (read now: the list lives in PREFIX), each removed
# only if nothing else has moved in.
mapfile -t made < <(awk '$1 == "dir" {print gsub("/", "/", $2), $2}' "$list" | sort -u | sort -k1,1nr | cut -d' ' -f2-)
rm -rf "${PREFIX:?}"
for path in "${made[@]}"; do
    [[ -d $path ]] && { rmdir "$path" 2>/dev/null || kept+=("$path (not empty)"); }
done
if [[ -d /run/systemd/system ]]; then systemctl daemon-reload || true; fi
echo "removed slurm-antman from $PREFIX"
for k in "${kept[@]}"; do echo "left: $k"; done
cat <<'MSG'
left for you (yours, not the install's): antman.yaml and the keys (/etc/slurm-antman), the state and
logs (/var/lib/slurm-antman, /var/log/slurm-antman), the Include/include lines in slurm.conf and
plugstack.conf, the Lua scripts beside slurm.conf; see "Removal" in docs/admin.md
MSG
