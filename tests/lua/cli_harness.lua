--[[
Runs a cli_filter.lua (etc/cli_filter.lua, or a site's calling etc/antman_cli_filter.lua) under plain
Lua 5.1 with a stand-in for the `slurm` table that Slurm's cli_filter/lua provides, and prints the
outcome as one JSON line.

usage: lua5.1 cli_harness.lua SCRIPT CASE
  CASE  a Lua file returning { options = {...}, env = {...}, spank = "CLASS" }: srun's options (a name
        not given reads "unset", as 22.05's options table answers; setting "" unsets), the environment
        os.getenv sees (nothing else of the real one), and the class srun's --antman gave (it reaches the
        filter through slurm.json_cli_options, as "spank:antman").
Output: { rc = ..., call_error = ..., options = { the options set after the call }, error = [...] }.
]]

local script, case_path = arg[1], arg[2]
assert(script and case_path, "usage: lua5.1 cli_harness.lua SCRIPT CASE")
local case = dofile(case_path)

local logs = { error = {}, info = {} }
local function logger(kind)
  return function(fmt, ...) table.insert(logs[kind], string.format(fmt, ...)) end
end
slurm = {
  SUCCESS = 0, ERROR = -1,
  log_error = logger("error"), log_info = logger("info"), log_debug = logger("info"), log_verbose = logger("info"),
}
if case.spank then
  slurm.json_cli_options = function(_) return '{"spank:antman":"' .. case.spank .. '"}' end
end

local env = case.env or {}
os.getenv = function(name) return env[name] end
io.popen = function() error("the filter asked slurmctld (io.popen); this case should not need it") end

local data = case.options or {}
local options = setmetatable({}, {
  __index = function(_, k) local v = data[k]; if v == nil then return "unset" end; return v end,
  __newindex = function(_, k, v)
    if v == nil then error("bad argument #3 to '__newindex' (string expected, got nil)") end
    if v == "" then v = nil end
    data[k] = v
  end,
})

local function json_string(s)
  return '"' .. s:gsub('[%c"\\]', function(c) return string.format("\\u%04x", c:byte()) end) .. '"'
end
local function json(v)
  if type(v) == "string" then return json_string(v) end
  if type(v) == "number" then return string.format("%.17g", v) end
  if type(v) == "table" then
    local parts, keys = {}, {}
    if #v > 0 or next(v) == nil then
      for _, x in ipairs(v) do parts[#parts + 1] = json(x) end
      return "[" .. table.concat(parts, ",") .. "]"
    end
    for k in pairs(v) do keys[#keys + 1] = tostring(k) end
    table.sort(keys)
    for _, k in ipairs(keys) do parts[#parts + 1] = json_string(k) .. ":" .. json(v[k]) end
    return "{" .. table.concat(parts, ",") .. "}"
  end
  return "null"
end

local load_ok, load_err = pcall(dofile, script)
if not load_ok then
  print(json({ load_error = tostring(load_err) }))
  return
end
local out = {}
for _, name in ipairs({ "slurm_cli_setup_defaults", "slurm_cli_pre_submit", "slurm_cli_post_submit" }) do
  if type(_G[name]) ~= "function" then out.missing = (out.missing or "") .. name .. " " end
end
local ok, rc = pcall(slurm_cli_pre_submit, options, 0)
if ok then out.rc = rc else out.call_error = tostring(rc) end
out.options, out.error = data, logs.error
print(json(out))
