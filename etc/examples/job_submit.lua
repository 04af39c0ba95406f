--[[
An example of a site's own job_submit.lua (Slurm job_submit/lua, Lua 5.1) with slurm-antman added: the
site's rules stay as they were, and the one line marked below makes Slurm run slurm-antman's policy after
them (antman_job_submit.lua explains the order). tests/test_job_submit_lua.py and the devcluster's
site-script test (tests/test_site_scripts_cluster.py) run this very file.

The site's rules here, as a site might have them:
  * every job has a time limit: a job without --time gets DEFAULT_MINUTES, one asking for more than
    MAX_MINUTES is refused;
  * a user's update may not raise a job's time limit over MAX_MINUTES (root's may).
]]

local NO_VAL = 4294967294 -- Slurm's "not set" for a 32-bit field such as time_limit (minutes)
local DEFAULT_MINUTES = 24 * 60
local MAX_MINUTES = 7 * 24 * 60

local function time_set(minutes)
  return minutes ~= nil and minutes ~= NO_VAL
end

function slurm_job_submit(job_desc, part_list, submit_uid)
  if not time_set(job_desc.time_limit) then
    job_desc.time_limit = DEFAULT_MINUTES
  elseif job_desc.time_limit > MAX_MINUTES then
    slurm.log_user("site policy: a job may run at most 7 days (--time=7-0); this one asks for %d minutes",
      job_desc.time_limit)
    return slurm.ERROR
  end
  return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  if modify_uid ~= 0 and time_set(job_desc.time_limit) and job_desc.time_limit > MAX_MINUTES then
    slurm.log_info("site policy: user %d may not raise job %d's time limit to %d minutes", modify_uid,
      job_rec.job_id, job_desc.time_limit)
    return slurm.ERROR
  end
  return slurm.SUCCESS
end

-- slurm-antman: the one line a site adds (anywhere at the top level of its script).
dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "antman_job_submit.lua").chain()

return slurm.SUCCESS
