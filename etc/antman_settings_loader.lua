--[[
slurm-antman: what antman_job_submit.lua and antman_cli_filter.lua share (Lua 5.1): reading and checking
antman_settings.lua, and chaining their hooks after the site's own. Both load it with dofile from their
own directory (the directory of slurm.conf), where it is installed with them.

antman_settings.lua is written by `antman config render` from antman.yaml and returns a table of plain
data (format in docs/architecture.md). It runs with an empty environment: no access to slurm, io or os.

  local loader = dofile(DIR .. "/antman_settings_loader.lua")
  local s, err = loader.load(DIR .. "/antman_settings.lua", warn)   -- warn(fmt, ...) for unknown fields

Returns the settings table with defaults filled in, or nil and one sentence naming the file and field.
What a caller does with an error is its own policy: job_submit rejects every job (skipping the policy
silently would let opportunistic work onto guaranteed GPUs); cli_filter leaves the command unchanged.

  local site = loader.chain("antman_job_submit_chained", { slurm_job_submit = fn, ... })

makes Slurm's global hooks named in the table call its functions, and keeps the site's own functions of
those names, defined before the call or after it, in `site` (see chain below).
]]

local SLURM_NAME = "^[A-Za-z][A-Za-z0-9_%-]*$"
local CLASS_VALUES = { none = true, guaranteed = true, opportunistic = true }
local KNOWN_KEYS = {
  default_class = true, auto_class = true, gpu_gres = true, opp_gres = true,
  guaranteed_partition = true, opp_partition = true, opp_qos = true, max_node_gpus = true,
  gpu_types = true, opp_switch_wait_s = true,
}

local function quoted(v)
  if v == nil then return "nothing" end
  if type(v) == "string" then return string.format("%q", v) end
  return tostring(v)
end

local function whole_positive(v)
  return type(v) == "number" and v >= 1 and v == math.floor(v) and v < math.huge
end

local function validate(s, warn)
  for _, key in ipairs({ "gpu_gres", "opp_gres", "guaranteed_partition", "opp_partition" }) do
    local v = s[key]
    if type(v) ~= "string" or not v:match(SLURM_NAME) then
      return string.format("field %s must be a Slurm name (letters, digits, '_' and '-'), got %s", key, quoted(v))
    end
  end
  if s.gpu_gres == s.opp_gres then return "gpu_gres and opp_gres must differ" end
  if s.guaranteed_partition == s.opp_partition then
    return "guaranteed_partition and opp_partition must differ"
  end
  if s.default_class == nil then s.default_class = "none" end
  if not CLASS_VALUES[s.default_class] then
    return string.format("field default_class is %s; allowed: none, guaranteed, opportunistic", quoted(s.default_class))
  end
  if s.auto_class == nil then
    -- docs/architecture.md: auto follows the default class, or guaranteed when that is none
    s.auto_class = (s.default_class == "none") and "guaranteed" or s.default_class
  end
  if s.auto_class ~= "guaranteed" and s.auto_class ~= "opportunistic" then
    return string.format("field auto_class is %s; allowed: guaranteed, opportunistic", quoted(s.auto_class))
  end
  if s.opp_qos ~= nil and (type(s.opp_qos) ~= "string" or s.opp_qos == "") then
    return "field opp_qos must be a QOS name or nil"
  end
  local m = s.max_node_gpus
  if m == nil then
    return "field max_node_gpus is missing (the file predates it); run `antman config render` and install " ..
      "the new antman_settings.lua"
  end
  if not whole_positive(m) then
    return string.format("field max_node_gpus must be a positive whole number of GPUs, got %s", quoted(m))
  end
  local w = s.opp_switch_wait_s
  if w ~= nil and not (type(w) == "number" and w >= 0 and w == math.floor(w) and w < math.huge) then
    return string.format("field opp_switch_wait_s must be a whole number of seconds or nil, got %s", quoted(w))
  end
  -- gpu_types: { h100 = 8, ... }: the GPU types of antman.yaml's node groups, each with the most GPUs
  -- one node of that type has. Absent: no node group declares a type.
  if s.gpu_types == nil then s.gpu_types = {} end
  if type(s.gpu_types) ~= "table" then
    return string.format("field gpu_types must be a table of GPU type = GPUs per node, got %s", quoted(s.gpu_types))
  end
  for t, n in pairs(s.gpu_types) do
    if type(t) ~= "string" or not t:match(SLURM_NAME) then
      return string.format("field gpu_types has the key %s; a GPU type is a Slurm name (letters, digits, '_' " ..
        "and '-')", quoted(t))
    end
    if not whole_positive(n) then
      return string.format("field gpu_types.%s must be a positive whole number of GPUs, got %s", t, quoted(n))
    end
  end
  for key in pairs(s) do
    if not KNOWN_KEYS[key] and warn then warn("ignoring unknown field %s", tostring(key)) end
  end
  return nil
end

local M = {}

--[[
Slurm looks its hooks up with lua_getglobal, which honours _G's __index: `entry`'s functions answer there,
outside _G's own table, so that a site's `function slurm_job_submit` written after the chaining line
reaches __newindex and lands in the returned `site` table instead of replacing slurm-antman's hook.
Whatever __index/__newindex _G had before keeps working for every other name.

`marker` is set on _G's metatable, not in the caller's chunk: each dofile of a module's line loads a new
copy of it, and a second chain would take the hooks away from the first, with the site's functions. A
second call returns nil and changes nothing.
]]
function M.chain(marker, entry)
  local mt = getmetatable(_G)
  if mt ~= nil and rawget(mt, marker) then return nil end
  local site = {}
  for name in pairs(entry) do
    site[name] = rawget(_G, name)
    rawset(_G, name, nil)
  end
  if mt == nil then
    mt = {}
    setmetatable(_G, mt)
  end
  rawset(mt, marker, true)
  local prev_index, prev_newindex = mt.__index, mt.__newindex
  mt.__index = function(t, k)
    if entry[k] then return entry[k] end
    if type(prev_index) == "function" then return prev_index(t, k) end
    if type(prev_index) == "table" then return prev_index[k] end
    return nil
  end
  mt.__newindex = function(t, k, v)
    if entry[k] then
      site[k] = v
      return
    end
    if type(prev_newindex) == "function" then return prev_newindex(t, k, v) end
    if type(prev_newindex) == "table" then
      prev_newindex[k] = v
      return
    end
    rawset(t, k, v)
  end
  return site
end

-- Read on every call by the callers, so an admin's re-render takes effect without touching the scripts.
function M.load(path, warn)
  local chunk, err = loadfile(path)
  if not chunk then return nil, "cannot read settings: " .. tostring(err) end
  setfenv(chunk, {}) -- settings are plain data; they get no access to slurm, io or os
  local ok, s = pcall(chunk)
  if not ok then return nil, string.format("error in settings %s: %s", path, tostring(s)) end
  if type(s) ~= "table" then
    return nil, string.format("settings %s must return a table, returned %s", path, type(s))
  end
  local problem = validate(s, warn and function(fmt, ...) warn("settings %s: " .. fmt, path, ...) end)
  if problem then return nil, string.format("settings %s: %s", path, problem) end
  return s
end

return M
