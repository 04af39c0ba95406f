--[[
slurm-antman job_submit.lua (Slurm 22.05 job_submit/lua, Lua 5.1)

Classifies every job and applies the AntMan policy at submission:

  * The class comes from the SPANK plugin as "ANTMAN_CLASS=<class>" in job_desc.spank_job_env
    (guaranteed | opportunistic | auto). No flag means settings.default_class
    (none | guaranteed | opportunistic); "none" leaves the job to plain Slurm, untagged.
    A job that gets its class only from default_class and asks for no GPU stays untouched:
    a CPU-only job has nothing to share.
  * auto resolves to settings.auto_class (guaranteed | opportunistic) and the tag records the
    request (antman:class=CLASS;req=auto), so the coordinator can re-resolve it by tenant quota
    while the job is pending.
  * guaranteed keeps the physical GPU GRES and is tagged AdminComment=antman:class=guaranteed.
    It may not ask for the opportunistic partition.
  * opportunistic has its GPU requests (--gres/--gpus-per-node, and on one node also --gpus,
    --gpus-per-task, --gpus-per-socket) rewritten to the count-only settings.opp_gres with the
    same count (a GPU type is dropped), is routed to settings.opp_partition (and
    settings.opp_qos when set), made requeueable, and tagged antman:class=opportunistic.
  * Only slurm-antman hands out settings.opp_gres: other classes asking for it are rejected.

Settings come from antman_settings.lua next to this file (written by `antman config render`;
format in docs/architecture.md). A missing or broken settings file rejects every job: skipping
the policy silently would let opportunistic work onto guaranteed GPUs.

Slurm lets a job through unchanged when this script raises a Lua error, so all logic runs
under pcall and an internal error rejects the job instead.

slurm_job_modify keeps an opportunistic job (known by its AdminComment tag) off the physical
GPU GRES and the guaranteed partition, and keeps it requeueable, since preemption needs that.
Root may upgrade a job by setting AdminComment=antman:class=guaranteed in the same update.
22.05 discards log_user text on modify, so a refused update returns ESLURM_ACCESS_DENIED
("Access/permission denied") and the reason goes to the slurmctld log.
]]

local NO_VAL = 4294967294
local NO_VAL16 = 65534
local TAG_PREFIX = "antman:class="
local TRES_FIELDS = { "tres_per_node", "tres_per_job", "tres_per_task", "tres_per_socket" }
local TRES_OPTION = {
  tres_per_node = "--gres/--gpus-per-node",
  tres_per_job = "--gpus",
  tres_per_task = "--gpus-per-task",
  tres_per_socket = "--gpus-per-socket",
}
local SLURM_NAME = "^[A-Za-z][A-Za-z0-9_%-]*$"

-- Resolved once at load: Slurm loads this file by path, so the chunk source is "@/dir/job_submit.lua".
local function script_dir()
  local src = debug.getinfo(1, "S").source or ""
  if src:sub(1, 1) == "@" then src = src:sub(2) end
  return src:match("^(.*)/[^/]*$") or "."
end

local SETTINGS_PATH = script_dir() .. "/antman_settings.lua"

-- A rejection the user should read, as opposed to an internal error (a bug).
local Reject = {}
Reject.__index = Reject

local function reject(fmt, ...)
  error(setmetatable({ msg = string.format(fmt, ...) }, Reject), 0)
end

local function info(fmt, ...)
  slurm.log_info("%s", "slurm-antman: " .. string.format(fmt, ...))
end

local function is_set(v, unset)
  return v ~= nil and v ~= unset and v ~= NO_VAL and v ~= 0
end

---------------------------------------------------------------------------------------------
-- settings

local CLASS_VALUES = { none = true, guaranteed = true, opportunistic = true }
local KNOWN_KEYS = {
  default_class = true, auto_class = true, gpu_gres = true, opp_gres = true,
  guaranteed_partition = true, opp_partition = true, opp_qos = true,
}

local function validate_settings(s)
  local function name_field(key)
    local v = s[key]
    if type(v) ~= "string" or not v:match(SLURM_NAME) then
      return string.format("field %s must be a Slurm name (letters, digits, '_' and '-'), got %s",
        key, v == nil and "nothing" or string.format("%q", tostring(v)))
    end
  end
  for _, key in ipairs({ "gpu_gres", "opp_gres", "guaranteed_partition", "opp_partition" }) do
    local problem = name_field(key)
    if problem then return problem end
  end
  if s.gpu_gres == s.opp_gres then return "gpu_gres and opp_gres must differ" end
  if s.guaranteed_partition == s.opp_partition then
    return "guaranteed_partition and opp_partition must differ"
  end
  if s.default_class == nil then s.default_class = "none" end
  if not CLASS_VALUES[s.default_class] then
    return string.format("field default_class is %q; allowed: none, guaranteed, opportunistic",
      tostring(s.default_class))
  end
  if s.auto_class == nil then
    -- docs/architecture.md: auto follows the default class, or guaranteed when that is none
    s.auto_class = (s.default_class == "none") and "guaranteed" or s.default_class
  end
  if s.auto_class ~= "guaranteed" and s.auto_class ~= "opportunistic" then
    return string.format("field auto_class is %q; allowed: guaranteed, opportunistic", tostring(s.auto_class))
  end
  if s.opp_qos ~= nil and (type(s.opp_qos) ~= "string" or s.opp_qos == "") then
    return "field opp_qos must be a QOS name or nil"
  end
  for key in pairs(s) do
    if not KNOWN_KEYS[key] then info("settings %s: ignoring unknown field %s", SETTINGS_PATH, tostring(key)) end
  end
  return nil
end

-- Read on every call so an admin's re-render takes effect without touching job_submit.lua.
local function load_settings()
  local chunk, err = loadfile(SETTINGS_PATH)
  if not chunk then return nil, "cannot read settings: " .. tostring(err) end
  setfenv(chunk, {}) -- settings are plain data; they get no access to slurm, io or os
  local ok, s = pcall(chunk)
  if not ok then return nil, string.format("error in settings %s: %s", SETTINGS_PATH, tostring(s)) end
  if type(s) ~= "table" then
    return nil, string.format("settings %s must return a table, returned %s", SETTINGS_PATH, type(s))
  end
  local problem = validate_settings(s)
  if problem then return nil, string.format("settings %s: %s", SETTINGS_PATH, problem) end
  return s
end

---------------------------------------------------------------------------------------------
-- TRES strings: "gres:gpu:2,gres:gpu:a100:1,gres:nic:1" in Slurm 22.05, "gres/gpu:2,gres/nic:1"
-- in 24.11; scontrol update may omit the prefix. What this script writes back uses the prefix the
-- job came with (gres_prefix), so one code path serves both versions.

local function split(s, sep)
  local out = {}
  for part in (s .. sep):gmatch("(.-)" .. sep) do out[#out + 1] = part end
  return out
end

-- One entry -> {name=, type=, count=} (count nil when it is not a plain number).
local function parse_entry(entry)
  local body, prefix = entry, nil
  if body:sub(1, 5) == "gres:" or body:sub(1, 5) == "gres/" then body, prefix = body:sub(6), body:sub(1, 5) end
  local parts = split(body, ":")
  local e = { raw = entry, name = parts[1], count = 1, prefix = prefix }
  if #parts >= 2 then
    local last = parts[#parts]
    if last:match("^%d+$") then
      e.count = tonumber(last)
      if #parts > 2 then e.type = table.concat(parts, ":", 2, #parts - 1) end
    elseif #parts == 2 then
      e.type = last
    else
      e.count = nil
    end
  end
  return e
end

local function parse_tres(value, field)
  if value == nil or value == "" then return {} end
  if type(value) ~= "string" then
    error(string.format("job_desc.%s is a %s, expected a string", field, type(value)))
  end
  local entries = {}
  for _, raw in ipairs(split(value, ",")) do
    if raw ~= "" then entries[#entries + 1] = parse_entry(raw) end
  end
  return entries
end

-- The GRES prefix this job's TRES fields use ("gres:" from 22.05, "gres/" from 24.11).
local function gres_prefix(job_desc)
  for _, field in ipairs(TRES_FIELDS) do
    for _, e in ipairs(parse_tres(job_desc[field], field)) do
      if e.prefix then return e.prefix end
    end
  end
  return "gres:"
end

local function gpu_count(entry, field)
  if entry.count == nil then
    reject("cannot read the GPU count in %s request %q; use --gres=gpu:N", TRES_OPTION[field], entry.raw)
  end
  return entry.count
end

local function mentions(entries, name)
  for _, e in ipairs(entries) do if e.name == name then return true end end
  return false
end

local function partitions(value)
  if type(value) ~= "string" or value == "" then return {} end
  return split(value, ",")
end

local function has_partition(value, name)
  for _, p in ipairs(partitions(value)) do if p == name then return true end end
  return false
end

---------------------------------------------------------------------------------------------
-- classification

local function class_from_env(env)
  if env == nil then return nil end
  if type(env) ~= "table" then error("job_desc.spank_job_env is a " .. type(env) .. ", expected a table") end
  local found
  -- 22.05 indexes this table from 0, so ipairs would miss the first entry
  for _, entry in pairs(env) do
    if type(entry) == "string" and entry:sub(1, 13) == "ANTMAN_CLASS=" then found = entry:sub(14) end
  end
  return found
end

local function requests_gpu(job_desc, s)
  for _, field in ipairs(TRES_FIELDS) do
    if mentions(parse_tres(job_desc[field], field), s.gpu_gres) then return true end
  end
  return false
end

local function job_label(job_desc)
  return string.format("job %q of %s", tostring(job_desc.name or "?"),
    tostring(job_desc.user_name or job_desc.user_id or "?"))
end

local function forbid_opp_gres(job_desc, s, class)
  for _, field in ipairs(TRES_FIELDS) do
    if mentions(parse_tres(job_desc[field], field), s.opp_gres) then
      reject("the %s GRES is handed out by slurm-antman only, and this job is class %s; " ..
        "ask for opportunistic GPUs with --antman=opportunistic --gres=%s:N", s.opp_gres, class, s.gpu_gres)
    end
  end
end

local function single_node(job_desc)
  local mn, mx = job_desc.min_nodes, job_desc.max_nodes
  return (not is_set(mn) or mn == 1) and (not is_set(mx) or mx == 1)
end

-- Converts a per-job/per-task/per-socket GPU count into the GPUs the single node must hold.
local function per_node_equivalent(job_desc, field, count)
  if field == "tres_per_job" then return count end
  if field == "tres_per_task" then
    local tasks = job_desc.num_tasks
    if not is_set(tasks) then tasks = job_desc.ntasks_per_node end
    if not is_set(tasks, NO_VAL16) then tasks = 1 end
    return count * tasks
  end
  local sockets = job_desc.sockets_per_node
  if not is_set(sockets, NO_VAL16) then
    reject("--gpus-per-socket needs --sockets-per-node for an opportunistic job; or use --gres=gpu:N")
  end
  return count * sockets
end

-- Replaces the GPU name in a per-GPU option (--cpus-per-gpu, --mem-per-gpu) by the opp GRES.
local function retarget_per_gpu(value, s, prefix)
  if type(value) ~= "string" or value == "" then return value end
  local out = {}
  for _, raw in ipairs(split(value, ",")) do
    local e = parse_entry(raw)
    if e.name == s.gpu_gres then
      local rest = raw:sub(e.prefix and 6 or 1):sub(#s.gpu_gres + 1)
      raw = (e.prefix or prefix) .. s.opp_gres .. rest
    end
    out[#out + 1] = raw
  end
  return table.concat(out, ",")
end

local function make_opportunistic(job_desc, s)
  if is_set(job_desc.ntasks_per_tres, NO_VAL16) then
    reject("--ntasks-per-gpu is not supported for opportunistic jobs; use --ntasks or --ntasks-per-node")
  end
  local requested = {}
  for _, field in ipairs(TRES_FIELDS) do
    if job_desc[field] ~= nil and job_desc[field] ~= "" then
      requested[#requested + 1] = field .. "=" .. tostring(job_desc[field])
    end
  end
  local prefix = gres_prefix(job_desc)
  local opp_total, kept, dropped_types = 0, {}, {}
  local node_gpu, other_gpu_field = false, nil
  for _, e in ipairs(parse_tres(job_desc.tres_per_node, "tres_per_node")) do
    if e.name == s.gpu_gres then
      opp_total = opp_total + gpu_count(e, "tres_per_node")
      node_gpu = true
      if e.type then dropped_types[#dropped_types + 1] = e.type end
    elseif e.name == s.opp_gres then
      opp_total = opp_total + gpu_count(e, "tres_per_node")
    else
      kept[#kept + 1] = e.raw
    end
  end
  for _, field in ipairs({ "tres_per_job", "tres_per_task", "tres_per_socket" }) do
    local rest, changed = {}, false
    for _, e in ipairs(parse_tres(job_desc[field], field)) do
      if e.name == s.gpu_gres or e.name == s.opp_gres then
        local first = other_gpu_field or (node_gpu and "tres_per_node")
        if first and first ~= field then
          reject("this job asks for GPUs in two ways (%s and %s); an opportunistic job asks once, " ..
            "with --gres=%s:N", TRES_OPTION[first], TRES_OPTION[field], s.gpu_gres)
        end
        if not single_node(job_desc) then
          reject("%s cannot be turned into opportunistic GPU slots for a job on more than one node; " ..
            "use --gres=%s:N (GPUs per node) instead", TRES_OPTION[field], s.gpu_gres)
        end
        other_gpu_field = field
        opp_total = opp_total + per_node_equivalent(job_desc, field, gpu_count(e, field))
        if e.type then dropped_types[#dropped_types + 1] = e.type end
        changed = true
      else
        rest[#rest + 1] = e.raw
      end
    end
    -- 22.05 clears a string field set to ""; nil would raise in the setter
    if changed then job_desc[field] = table.concat(rest, ",") end
  end
  if opp_total == 0 then
    reject("an opportunistic job must ask for GPUs; add --gres=%s:N", s.gpu_gres)
  end
  if other_gpu_field then job_desc.max_nodes = 1 end
  if #dropped_types > 0 then
    info("%s: GPU type %s dropped: opportunistic slots are not typed", job_label(job_desc),
      table.concat(dropped_types, ","))
  end
  kept[#kept + 1] = string.format("%s%s:%d", prefix, s.opp_gres, opp_total)
  job_desc.tres_per_node = table.concat(kept, ",")
  for _, field in ipairs({ "cpus_per_tres", "mem_per_tres" }) do
    local v = job_desc[field]
    local nv = retarget_per_gpu(v, s, prefix)
    if nv ~= v then job_desc[field] = nv end
  end
  local from_part = job_desc.partition
  job_desc.partition = s.opp_partition
  if s.opp_qos then job_desc.qos = s.opp_qos end
  job_desc.requeue = 1
  job_desc.admin_comment = TAG_PREFIX .. "opportunistic"
  info("%s: class opportunistic; GPUs %s -> %s; partition %s -> %s%s", job_label(job_desc),
    table.concat(requested, " "), job_desc.tres_per_node,
    tostring(from_part or "(default)"), s.opp_partition, s.opp_qos and ("; qos " .. s.opp_qos) or "")
end

local function make_guaranteed(job_desc, s)
  if has_partition(job_desc.partition, s.opp_partition) then
    reject("guaranteed jobs cannot use the %s partition, which holds opportunistic jobs; " ..
      "drop -p %s or submit with --antman=opportunistic", s.opp_partition, s.opp_partition)
  end
  forbid_opp_gres(job_desc, s, "guaranteed")
  job_desc.admin_comment = TAG_PREFIX .. "guaranteed"
  info("%s: class guaranteed", job_label(job_desc))
end

-- Tenant quota use, written by the coordinator every cycle (antman_quota.lua next to this file:
-- return { accounts = { research = { quota = 4, used = 3 } } }). Slurm 22.05 cannot move a pending
-- job's GRES request from gpu to the opportunistic GRES (the old request stays), so auto must be
-- resolved here, at submission; the file may lag a cycle behind, which the coordinator's quota
-- holds and upgrades correct.
local QUOTA_PATH = script_dir() .. "/antman_quota.lua"

local function load_quota()
  local chunk = loadfile(QUOTA_PATH)
  if not chunk then return nil end
  setfenv(chunk, {})
  local ok, q = pcall(chunk)
  if not ok or type(q) ~= "table" or type(q.accounts) ~= "table" then return nil end
  return q
end

local function resolve_auto(job_desc, s)
  local q = load_quota()
  if q == nil then return s.auto_class, "no quota file from the coordinator; site auto_class" end
  local account = job_desc.account
  local t = type(account) == "string" and q.accounts[account] or nil
  if t == nil or type(t.quota) ~= "number" or type(t.used) ~= "number" then
    return s.auto_class, string.format("account %s has no quota entry; site auto_class", tostring(account))
  end
  local want = 0
  for _, e in ipairs(parse_tres(job_desc.tres_per_node, "tres_per_node")) do
    if e.name == s.gpu_gres then want = want + (e.count or 1) end
  end
  if want == 0 then want = 1 end
  if t.used + want <= t.quota then
    return "guaranteed", string.format("tenant %s: %d of %d GPUs in use, needs %d", account, t.used, t.quota, want)
  end
  return "opportunistic", string.format("tenant %s over quota: %d of %d GPUs in use, needs %d", account,
    t.used, t.quota, want)
end

local function classify(job_desc, s)
  local requested = class_from_env(job_desc.spank_job_env)
  local class = requested
  if class == nil then
    class = s.default_class
    if class ~= "none" and not requests_gpu(job_desc, s) then class = "none" end
  elseif class == "auto" then
    local why
    class, why = resolve_auto(job_desc, s)
    info("%s: class auto resolved to %s (%s)", job_label(job_desc), class, why)
  elseif class ~= "guaranteed" and class ~= "opportunistic" then
    reject("unknown class %q in ANTMAN_CLASS; allowed: guaranteed, opportunistic, auto", class)
  end
  if class == "none" then
    forbid_opp_gres(job_desc, s, "none")
    return
  end
  if class == "guaranteed" then make_guaranteed(job_desc, s) else make_opportunistic(job_desc, s) end
  -- the coordinator resolves auto by tenant quota; it must know the user left the choice open
  if requested == "auto" then job_desc.admin_comment = job_desc.admin_comment .. ";req=auto" end
end

---------------------------------------------------------------------------------------------
-- Slurm entry points

-- Runs fn under pcall; a Reject or a bug both end in an error return, never in a job let through.
-- On submit the user reads the reason (log_user). On modify 22.05 discards log_user text and
-- logs an error for it, so the reason goes to the slurmctld log and the user gets "Access/permission
-- denied" for a policy refusal.
local function guarded(label, for_modify, fn)
  local ok, err = pcall(fn)
  if ok then return slurm.SUCCESS end
  local reason, rc
  if getmetatable(err) == Reject then
    reason = err.msg
    -- a broken site config is no permission problem of the user's
    local policy = for_modify and not err.config
    rc = policy and (slurm.ESLURM_ACCESS_DENIED or slurm.ERROR) or slurm.ERROR
  else
    reason = "internal error classifying job: " .. tostring(err) .. "; job rejected, contact your admin"
    rc = slurm.ERROR
  end
  slurm.log_info("%s", "slurm-antman: rejected " .. label .. ": " .. reason)
  if not for_modify then slurm.log_user("%s", "slurm-antman: " .. reason) end
  return rc
end

local function safe_label(fn, ...)
  local ok, label = pcall(fn, ...)
  return ok and label or "job ?"
end

local function settings_or_reject()
  local s, err = load_settings()
  if not s then
    error(setmetatable({ msg = err .. "; every job is rejected until an admin fixes it", config = true }, Reject), 0)
  end
  return s
end

function slurm_job_submit(job_desc, part_list, submit_uid)
  return guarded(safe_label(job_label, job_desc), false, function()
    classify(job_desc, settings_or_reject())
  end)
end

local function check_modify(job_desc, job_rec, modify_uid)
  local tag = job_rec.admin_comment
  local class = type(tag) == "string" and tag:match("^" .. TAG_PREFIX .. "([%w_]+)") or nil
  -- only opportunistic jobs are guarded, so a broken settings file does not block updates
  -- (hold, release, time limits) of every other job
  if class ~= "opportunistic" then return end
  local s = settings_or_reject()
  local new_tag = job_desc.admin_comment
  if modify_uid == 0 and type(new_tag) == "string" and new_tag:match("^" .. TAG_PREFIX .. "guaranteed") then
    info("job %s upgraded to guaranteed by root", tostring(job_rec.job_id))
    return
  end
  local who = string.format("job %s is opportunistic", tostring(job_rec.job_id))
  for _, field in ipairs(TRES_FIELDS) do
    if mentions(parse_tres(job_desc[field], field), s.gpu_gres) then
      reject("%s: it cannot be moved onto the physical %s GRES (%s); " ..
        "resubmit with --antman=guaranteed for dedicated GPUs", who, s.gpu_gres, TRES_OPTION[field])
    end
  end
  if has_partition(job_desc.partition, s.guaranteed_partition) then
    reject("%s: it cannot be moved to the %s partition; resubmit with --antman=guaranteed", who,
      s.guaranteed_partition)
  end
  if job_desc.requeue == 0 then
    reject("%s: it must stay requeueable, because slurm-antman preempts it by requeueing", who)
  end
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  local label = safe_label(function() return "update of job " .. tostring(job_rec.job_id) end)
  return guarded(label, true, function()
    check_modify(job_desc, job_rec, modify_uid)
  end)
end

info("job_submit.lua loaded; settings from %s", SETTINGS_PATH)
return slurm.SUCCESS
