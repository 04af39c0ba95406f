-- slurm-antman's cli_filter.lua, for a site that has no cli_filter.lua of its own (Slurm cli_filter/lua).
-- The logic is in antman_cli_filter.lua next to this file (the directory of slurm.conf, on every host
-- users run srun on). A site with its own cli_filter.lua keeps it and adds the line below to it instead
-- (etc/examples/cli_filter.lua).
dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "antman_cli_filter.lua").chain()
