--[[
An example of a site's own cli_filter.lua (Slurm cli_filter/lua, Lua 5.1) with slurm-antman added: the
site's rule stays as it was, and the one line marked below makes srun, sbatch and salloc run
slurm-antman's rewrite of srun's GPU options after it (antman_cli_filter.lua). tests/test_cli_filter_lua.py
and the devcluster's site-script test (tests/test_site_scripts_cluster.py) run this very file.

The site's rule here: --overcommit (-O) is not allowed (every CPU a task uses must be allocated to it).
]]

-- 22.05's options table answers "unset" for an option not given, not nil.
local function set(v)
  return v ~= nil and v ~= "" and v ~= "unset" and v ~= "invalid-context"
end

function slurm_cli_setup_defaults(options, early)
  return slurm.SUCCESS
end

function slurm_cli_pre_submit(options, offset)
  if set(options.overcommit) then
    slurm.log_error("site policy: --overcommit (-O) is not allowed on this cluster")
    return slurm.ERROR
  end
  return slurm.SUCCESS
end

function slurm_cli_post_submit(offset, job_id, step_id)
  return slurm.SUCCESS
end

-- slurm-antman: the one line a site adds (anywhere at the top level of its script).
dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "antman_cli_filter.lua").chain()
