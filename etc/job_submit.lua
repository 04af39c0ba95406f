-- slurm-antman's job_submit.lua, for a site that has no job_submit.lua of its own (Slurm job_submit/lua).
-- The policy is in antman_job_submit.lua next to this file (the directory of slurm.conf). A site with its
-- own job_submit.lua keeps it and adds the line below to it instead (etc/examples/job_submit.lua).
dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "antman_job_submit.lua").chain()
