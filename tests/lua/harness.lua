--[[
Runs etc/job_submit.lua under plain Lua 5.1 with a stand-in for the `slurm` table that
slurmctld's job_submit/lua plugin provides (22.05), and prints the outcome as one JSON line.

usage: lua5.1 harness.lua SCRIPT CASE
  SCRIPT  a copy of job_submit.lua (its directory holds the antman_settings.lua under test)
  CASE    a Lua file returning { call = "submit" | "modify", job_desc = {...},
          job_rec = {...}, uid = N, now = T }
          or { steps = { STEP, ... }, now = T }: one loaded script, several steps in order, as
          slurmctld keeps one Lua state across calls. A STEP is a call like the above (its `now`, if
          any, set first), or { write = NAME, text = "..." } to replace a file next to SCRIPT.
          `now` fixes os.time() from there on; without it the real clock runs.
          Output for steps: { results = [ one object per call ] }.

job_desc is wrapped like the real plugin wraps it: reads go through __index, and writes follow
the 22.05 setter (a string field set to "" becomes unset; nil is an error, as luaL_checkstring
raises), so the script is tested against the behaviour it meets in slurmctld.
]]

local script, case_path = arg[1], arg[2]
assert(script and case_path, "usage: lua5.1 harness.lua SCRIPT CASE")

local logs = { info = {}, user = {}, error = {} }
local function logger(kind)
  return function(fmt, ...) table.insert(logs[kind], string.format(fmt, ...)) end
end

slurm = {
  SUCCESS = 0, ERROR = -1, FAILURE = -1, ESLURM_ACCESS_DENIED = 2002,
  NO_VAL = 4294967294, NO_VAL16 = 65534,
  log_info = logger("info"), log_verbose = logger("info"), log_debug = logger("info"),
  log_error = logger("error"), log_user = logger("user"),
}

local function wrap_job_desc(data)
  local proxy = {}
  setmetatable(proxy, {
    __index = function(_, k) return data[k] end,
    __newindex = function(_, k, v)
      if v == nil then error("bad argument #3 to '__newindex' (string expected, got nil)") end
      if v == "" then v = nil end
      data[k] = v
    end,
  })
  return proxy
end

local function json_string(s)
  s = s:gsub('[%c"\\]', function(c)
    if c == '"' then return '\\"' elseif c == "\\" then return "\\\\" end
    return string.format("\\u%04x", c:byte())
  end)
  return '"' .. s .. '"'
end

local function json(v)
  local t = type(v)
  if t == "string" then return json_string(v)
  elseif t == "number" then return string.format("%.17g", v)
  elseif t == "boolean" then return tostring(v)
  elseif t == "table" then
    local parts, is_list = {}, #v > 0 or next(v) == nil
    if is_list then
      for _, x in ipairs(v) do parts[#parts + 1] = json(x) end
      return "[" .. table.concat(parts, ",") .. "]"
    end
    local keys = {}
    for k in pairs(v) do keys[#keys + 1] = tostring(k) end
    table.sort(keys)
    for _, k in ipairs(keys) do
      local x = v[k]
      if x == nil then x = v[tonumber(k)] end
      if type(x) ~= "function" then parts[#parts + 1] = json_string(k) .. ":" .. json(x) end
    end
    return "{" .. table.concat(parts, ",") .. "}"
  end
  return "null"
end

local case = dofile(case_path)

local real_time, fake_now = os.time, nil
os.time = function(t)
  if t ~= nil or fake_now == nil then return real_time(t) end
  return fake_now
end
if case.now then fake_now = case.now end

local function call(step)
  if step.now then fake_now = step.now end
  logs.info, logs.user, logs.error = {}, {}, {}
  local rc, call_err
  local data = step.job_desc or {}
  local ok, r = pcall(function()
    if step.call == "modify" then
      return slurm_job_modify(wrap_job_desc(data), step.job_rec or {}, {}, step.uid or 1000)
    end
    return slurm_job_submit(wrap_job_desc(data), {}, step.uid or 1000)
  end)
  if ok then rc = r else call_err = tostring(r) end
  -- only scalar fields: spank_job_env is input, not something the script changes
  local fields = {}
  for k, v in pairs(data) do
    if type(v) ~= "table" then fields[k] = v end
  end
  return { rc = rc, call_error = call_err, job_desc = fields, info = logs.info, user = logs.user,
           error = logs.error }
end

local dir = script:match("^(.*)/[^/]*$") or "."
local load_ok, load_err = pcall(dofile, script)
local load_logs = logs.info
if not load_ok then
  print(json({ load_error = tostring(load_err), info = load_logs, user = logs.user, error = logs.error }))
elseif case.steps then
  local results = {}
  -- the Python tests write lists 0-indexed, as 22.05 passes spank_job_env
  local i = case.steps[0] and 0 or 1
  while case.steps[i] do
    local step = case.steps[i]
    i = i + 1
    if step.write then
      local f = assert(io.open(dir .. "/" .. step.write, "w"))
      f:write(step.text)
      f:close()
    else
      results[#results + 1] = call(step)
    end
  end
  print(json({ results = results }))
else
  local out = call(case)
  for i, m in ipairs(load_logs) do table.insert(out.info, i, m) end
  print(json(out))
end
