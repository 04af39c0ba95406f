--[[
slurm-antman's cli_filter logic as a module (Slurm cli_filter/lua, Lua 5.1): srun's GPU options for
opportunistic jobs.

A site keeps its own cli_filter.lua and adds ONE line to it, anywhere at its top level:

  dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "antman_cli_filter.lua").chain()

etc/cli_filter.lua is that line alone, for a site without a cli_filter.lua of its own;
etc/examples/cli_filter.lua is a site filter with defaults of its own that calls this module.
chain() wraps the site's slurm_cli_setup_defaults, slurm_cli_pre_submit and slurm_cli_post_submit
(defined before or after the line): the site's pre_submit runs first and, when it succeeded, the
rewrite below, so it sees the options as the site's filter left them. An error in the site's own
functions is the site's, as without slurm-antman: it is not caught here.

An opportunistic job holds the count-only opportunistic GRES (settings.opp_gres), not the physical
GPU GRES: job_submit.lua rewrote its request. A job step asking for GPUs the usual way
(`srun --gres=gpu:1`, `--gpus=1`, `--gpus-per-node`, `--gpus-per-task`) would ask for a GRES the job
does not hold, and slurmctld refuses it ("Step requested GRES (gpu:(null)) not found in the job").
Slurm runs this filter in srun before it asks for the step (and, for `srun --antman=...` outside an
allocation, before it asks for the job), so the step asks for the same number of opportunistic slots
instead. Which GPUs the step's tasks see does not change: that is the job's placement, set on the node
(ANTMAN_GPUS, CUDA_VISIBLE_DEVICES, the devices cgroup). A GPU type is dropped for a step (the slots
the job holds are on its node already) and kept for a new job (`srun --antman=opportunistic
--gres=gpu:h100:1` must still land on an h100 node; job_submit keeps the type).

Nothing here is a security boundary: it runs in the user's srun, and slurmctld still lets a step use
only what its job holds. It only spares users a confusing error.

sbatch and salloc are left alone: job_submit.lua classifies and rewrites jobs at submission.
The settings are job_submit.lua's (antman_settings.lua next to this file, written by
`antman config render`, read by antman_settings_loader.lua); a missing or broken settings file leaves
every command unchanged.
]]

local NAME = "slurm-antman"
-- The resolved class, which the Prolog's env file puts into a job's environment (docs/protocol.md).
local CLASS_ENV = "ANTMAN_CLASS"

local function script_dir()
  local src = debug.getinfo(1, "S").source or ""
  if src:sub(1, 1) == "@" then src = src:sub(2) end
  return src:match("^(.*)/[^/]*$") or "."
end

local DIR = script_dir()
local SETTINGS_PATH = DIR .. "/antman_settings.lua"

local loader

-- antman_settings_loader.lua, or nil: on a login node a missing or broken one must not stop anyone's srun.
local function shared()
  if loader == nil then
    local ok, l = pcall(dofile, DIR .. "/antman_settings_loader.lua")
    if not ok or type(l) ~= "table" or type(l.load) ~= "function" then
      slurm.log_debug("%s: no settings loader next to antman_cli_filter.lua: %s", NAME, tostring(l))
      return nil
    end
    loader = l
  end
  return loader
end

-- The settings, or nil: as above, a missing or broken file leaves the command unchanged.
local function load_settings()
  local l = shared()
  if not l then return nil end
  local s, err = l.load(SETTINGS_PATH)
  if not s then slurm.log_debug("%s: %s; commands run unchanged", NAME, tostring(err)) end
  return s
end

-- A refusal the user reads, as opposed to a bug (which leaves the command as it was).
local Refuse = {}

local function refuse(fmt, ...)
  error(setmetatable({ msg = string.format(fmt, ...) }, Refuse), 0)
end

-- 22.05's options table answers "unset" for an option not given (and "invalid-context" for one
-- this command does not have), not nil.
local function set(v)
  return v ~= nil and v ~= "" and v ~= "unset" and v ~= "invalid-context"
end

local function split(s, sep)
  local out = {}
  for part in (s .. sep):gmatch("(.-)" .. sep) do
    if part ~= "" then out[#out + 1] = part end
  end
  return out
end

-- "[type:]N" of --gpus, --gpus-per-node, --gpus-per-task -> N.
local function gpu_count(value, option)
  local n = tostring(value):match("^[%w_%-]*:?(%d+)$")
  if not n then refuse("cannot read the GPU count in %s=%s; use --gres=gpu:N", option, tostring(value)) end
  return tonumber(n)
end

-- The type of "[type:]N" (--gpus*), or nil.
local function option_type(value)
  return tostring(value):match("^([%a][%w_%-]*):%d+$")
end

-- The class srun's own --antman gave, as the SPANK plugin registered it; 22.05's options table
-- does not index SPANK options, its JSON form carries them.
local function spank_class(options)
  if not slurm.json_cli_options then return nil end
  local ok, json = pcall(slurm.json_cli_options, options)
  if not ok or type(json) ~= "string" then return nil end
  return json:match('"spank:antman"%s*:%s*"([%w_]+)"')
end

-- Whether the allocation the step runs in holds opportunistic slots (asked of slurmctld, for a
-- salloc shell or a job whose class was auto, where the job's environment does not say).
local function job_holds(job_id, gres)
  if not tostring(job_id):match("^%d+$") then return false end
  local p = io.popen("scontrol show job -o " .. job_id .. " 2>/dev/null")
  if not p then return false end
  local out = p:read("*a") or ""
  p:close()
  return out:find("gres[:/]" .. gres:gsub("%-", "%%-") .. "[:=,%s]") ~= nil
end

-- (class, whether srun runs a step in an existing allocation).
local function job_class(options, s)
  local in_job = (set(options.jobid) and options.jobid) or os.getenv("SLURM_JOB_ID")
  local spank = spank_class(options)
  if in_job then
    -- The Prolog's env file put the resolved class into the batch script's and tasks' environment.
    local class = os.getenv(CLASS_ENV)
    if class == "guaranteed" or class == "opportunistic" then return class, true end
    if spank == "guaranteed" or spank == "opportunistic" then return spank, true end
    return job_holds(in_job, s.opp_gres) and "opportunistic" or "other", true
  end
  if spank == nil and s.default_class == "opportunistic" then return "opportunistic", false end
  return spank or "other", false
end

local function asks_for_gpus(options, s)
  if set(options.gpus) or set(options["gpus-per-node"]) or set(options["gpus-per-task"])
      or set(options["gpus-per-socket"]) then
    return true
  end
  for _, e in ipairs(split(set(options.gres) and options.gres or "", ",")) do
    if e:gsub("^gres[:/]", ""):match("^[^:]+") == s.gpu_gres then return true end
  end
  return false
end

local function one_node(options)
  local n = options.nodes
  return not set(n) or n == "1" or n == "1-1" or n == "1-0"
end

-- Every way srun asks for GPUs, as one per-node count of opportunistic slots in --gres; `new_job`:
-- srun makes the job (outside an allocation), so a GPU type is kept for job_submit.lua to place by.
local function to_opportunistic(options, s, new_job)
  -- Entries are written back as a user types them (NAME:N): srun's setter adds the TRES prefix of its
  -- own version ("gres:" in 22.05, "gres/" in 24.11, which refuses the other).
  local kept, per_node, types = {}, 0, {}
  local function typed(t)
    if t and new_job then
      if types[1] and types[1] ~= t then
        refuse("an opportunistic job asks for GPUs of one type; this srun asks for %s and %s", types[1], t)
      end
      types[1] = t
    end
  end
  for _, e in ipairs(split(set(options.gres) and options.gres or "", ",")) do
    local body = e:gsub("^gres[:/]", "")
    local parts = split(body, ":")
    if parts[1] == s.gpu_gres or parts[1] == s.opp_gres then
      local last = parts[#parts]
      local counted = #parts >= 2 and last:match("^%d+$")
      per_node = per_node + (counted and tonumber(last) or 1)
      if #parts == 3 or (#parts == 2 and not counted) then typed(parts[2]) end
    else
      kept[#kept + 1] = body
    end
  end
  if set(options["gpus-per-socket"]) then
    refuse("--gpus-per-socket is not supported for opportunistic steps; use --gres=%s:N", s.gpu_gres)
  end
  if set(options["gpus-per-node"]) then
    per_node = per_node + gpu_count(options["gpus-per-node"], "--gpus-per-node")
    typed(option_type(options["gpus-per-node"]))
    options["gpus-per-node"] = "" -- 22.05's setter takes "" as unset; nil raises
  end
  for _, opt in ipairs({ "gpus", "gpus-per-task" }) do
    if set(options[opt]) then
      if not one_node(options) then
        refuse("--%s cannot be turned into opportunistic GPU slots for a step on more than one node; " ..
          "use --gres=%s:N (GPUs per node)", opt, s.gpu_gres)
      end
      local n = gpu_count(options[opt], "--" .. opt)
      if opt == "gpus-per-task" then n = n * (set(options.ntasks) and tonumber(options.ntasks) or 1) end
      per_node = per_node + n
      typed(option_type(options[opt]))
      options[opt] = ""
    end
  end
  kept[#kept + 1] = types[1] and string.format("%s:%s:%d", s.opp_gres, types[1], per_node) or
    string.format("%s:%d", s.opp_gres, per_node)
  options.gres = table.concat(kept, ",")
end

local function filter(options)
  if options.type ~= "srun" then return end
  local s = load_settings()
  if not s or not asks_for_gpus(options, s) then return end
  local class, in_job = job_class(options, s)
  if class == "auto" then
    refuse("srun --antman=auto with GPUs outside an allocation: the class is decided when the job is " ..
      "submitted, after srun has asked for its step's GPUs; use salloc or sbatch --antman=auto and srun " ..
      "inside, or name the class (--antman=guaranteed or --antman=opportunistic)")
  end
  if class ~= "opportunistic" then return end
  local before = options.gres
  to_opportunistic(options, s, not in_job)
  slurm.log_debug("%s: opportunistic step: GPUs %s -> %s", NAME, tostring(before), options.gres)
end

local M = {}

-- The rewrite for one command: slurm.SUCCESS, or slurm.ERROR with the reason logged for the user.
function M.pre_submit(options, offset)
  local ok, err = pcall(filter, options)
  if ok then return slurm.SUCCESS end
  if getmetatable(err) == Refuse then
    slurm.log_error("%s: %s", NAME, err.msg)
    return slurm.ERROR
  end
  -- A bug here must not stop every srun on the cluster: the step goes to slurmctld as asked.
  slurm.log_error("%s: cli_filter internal error (%s); the command runs unchanged", NAME, tostring(err))
  return slurm.SUCCESS
end

local HOOKS = { "slurm_cli_setup_defaults", "slurm_cli_pre_submit", "slurm_cli_post_submit" }

-- As antman_job_submit.lua's chain(): the three globals Slurm calls run the site's functions (defined
-- before or after this call; antman_settings_loader.lua's chain catches the later ones), and pre_submit
-- then the rewrite.
function M.chain()
  local l = shared()
  if not l or type(l.chain) ~= "function" then
    -- Without the loader the rewrite leaves every command unchanged anyway; Slurm still needs the three
    -- hooks, so the ones the site has not defined (yet) pass. A later definition simply replaces them.
    for _, name in ipairs(HOOKS) do
      if rawget(_G, name) == nil then rawset(_G, name, function() return slurm.SUCCESS end) end
    end
    return M
  end
  local site
  local function call_site(name, ...)
    if site[name] == nil then return slurm.SUCCESS end
    return tonumber((site[name](...))) or slurm.SUCCESS
  end
  site = l.chain("antman_cli_filter_chained", {
    slurm_cli_setup_defaults = function(options, early) return call_site("slurm_cli_setup_defaults", options, early) end,
    slurm_cli_post_submit = function(offset, job_id, step_id)
      return call_site("slurm_cli_post_submit", offset, job_id, step_id)
    end,
    slurm_cli_pre_submit = function(options, offset)
      local rc = call_site("slurm_cli_pre_submit", options, offset)
      if rc ~= slurm.SUCCESS then return rc end
      return M.pre_submit(options, offset)
    end,
  })
  return M
end

return M
