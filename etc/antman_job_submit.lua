--[[
slurm-antman's job_submit logic as a module (Slurm job_submit/lua, Lua 5.1; Slurm 22.05 to 24.11).

A site keeps its own job_submit.lua and adds ONE line to it, anywhere at its top level:

  dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "antman_job_submit.lua").chain()

(the directory of the calling script: Slurm loads job_submit.lua by its full path from the directory of
slurm.conf, and this module, antman_settings_loader.lua and antman_settings.lua live beside it).
etc/job_submit.lua is that one line alone, for a site without a script of its own;
etc/examples/job_submit.lua is a site script with rules of its own that calls this module.

chain() wraps the site's slurm_job_submit and slurm_job_modify, whether they are defined before or after
the line: Slurm calls the wrapper, which runs the site's function first and, when that succeeded, the
slurm-antman policy below. Why this order:
  * antman classifies the job the site let through, as the site left it: a default account or partition
    the site sets is what quota resolution (auto) and routing see, and a site rule that sets
    job_desc.partition for every job cannot route an opportunistic job back into the guaranteed
    partition, because the routing comes after it;
  * a job the site refuses never reaches antman, so it takes no tenant quota (guaranteed admissions are
    counted here, in slurmctld's Lua state, see `admitted`);
  * an error in the site's function rejects the job (logged, and told to the user): letting it through
    unclassified would put opportunistic work on guaranteed GPUs.
A site that wants another order calls the policy itself instead of chain():
  local antman = dofile(...)   -- the same path
  function slurm_job_submit(job_desc, part_list, submit_uid)
    ... ; return antman.job_submit(job_desc, part_list, submit_uid)
  end
(and antman.job_modify(job_desc, job_rec, part_list, modify_uid) likewise).

Slurm reloads job_submit.lua when that file changes, not when this module does: after installing a new
antman_job_submit.lua, `touch job_submit.lua` (or restart slurmctld).

The policy:

  * The class comes from the SPANK plugin as "ANTMAN_CLASS=<class>" in job_desc.spank_job_env
    (guaranteed | opportunistic | auto). No flag means settings.default_class
    (none | guaranteed | opportunistic); "none" leaves the job to plain Slurm, untagged.
    A job that gets its class only from default_class and asks for no GPU stays untouched:
    a CPU-only job has nothing to share.
  * auto resolves by tenant quota: guaranteed when the job's GPUs fit in what the coordinator's
    quota file (antman_quota.lua) leaves, less the guaranteed admissions made here since that file's
    snapshot; opportunistic otherwise; settings.auto_class without a quota file or an entry for the
    account. The tag records the request (antman:class=CLASS;req=auto), so the coordinator can
    re-resolve it while the job is pending.
  * guaranteed keeps the physical GPU GRES (with its type, --gres=gpu:h100:1) and is tagged
    AdminComment=antman:class=guaranteed. It may not ask for the opportunistic partition.
  * opportunistic has its GPU requests (--gres/--gpus-per-node, and on one node also --gpus,
    --gpus-per-task, --gpus-per-socket) rewritten to the count-only settings.opp_gres with the
    same count, is routed to settings.opp_partition (and settings.opp_qos when set), made requeueable,
    asked onto one leaf switch within settings.opp_switch_wait_s (unless the user set --switches or
    named several nodes with -w), kept on one node (max_nodes=1) unless it chose its nodes (-N, -n over
    --ntasks-per-node, a node list, --spread-job), and tagged antman:class=opportunistic. A GPU type
    stays: --gres=gpu:h100:1 becomes opp_gres:h100:1, which only nodes whose opportunistic slots are
    typed h100 (antman.yaml nodes[].gpu_type) offer, so Slurm itself places the job on a node of that
    type. One type per job; a type no node group has is refused. More GPUs per node than the largest
    node (of that type) has is refused.
  * Elastic width (docs/elastic.md): --antman-elastic=MIN:MAX reaches this script as
    "ANTMAN_ELASTIC=MIN:MAX" in job_desc.spank_job_env and is checked again here (a client may set
    the env without the plugin): only with --antman=opportunistic or auto; two numbers, 1 <= MIN <=
    MAX <= 64, no sign or leading zero; MAX equal to the GPUs per node the job asks for; one node. A
    job array (job_desc.array_inx) of one-node tasks of G GPUs each may instead be one job across its
    K >= 2 tasks' nodes: MAX = K x G, MIN a multiple of G, no %N throttle (the coordinator sets it). It is
    recorded in the tag as elastic=MIN:MAX (antman:class=opportunistic[;req=auto];elastic=MIN:MAX) and
    the job (each task) is kept on one node (max_nodes=1). An auto job that resolves to guaranteed drops it: a guaranteed job's width is its
    own.
  * Heterogeneous jobs (--het-group, ':') of any slurm-antman class are refused.
  * Only slurm-antman hands out settings.opp_gres: other classes asking for it are rejected.

Settings come from antman_settings.lua next to this file (written by `antman config render`; read and
checked by antman_settings_loader.lua). A missing or broken settings file rejects every job.

Slurm's handling of a Lua error differs between versions (the job let through, or refused without a
reason), so all logic runs under pcall and an internal error rejects the job with a message.

job_modify keeps an opportunistic job (known by its AdminComment tag) off the physical
GPU GRES and the guaranteed partition, and keeps it requeueable, since preemption needs that.
Root may upgrade a job by setting AdminComment=antman:class=guaranteed in the same update.
22.05 discards log_user text on modify, so a refused update returns ESLURM_ACCESS_DENIED
("Access/permission denied") and the reason goes to the slurmctld log.
]]

local NO_VAL = 4294967294
local NO_VAL16 = 65534
local TAG_PREFIX = "antman:"
-- Where the SPANK plugin puts --antman=CLASS and --antman-elastic=MIN:MAX (docs/protocol.md,
-- "Environment variables").
local CLASS_ENV = "ANTMAN_CLASS"
local ELASTIC_ENV = "ANTMAN_ELASTIC"
-- An elastic range's bound (MIN <= MAX <= ELASTIC_MAX_GPUS): job_register's gpus bound, docs/protocol.md.
local ELASTIC_MAX_GPUS = 64
local TRES_FIELDS = { "tres_per_node", "tres_per_job", "tres_per_task", "tres_per_socket" }
local TRES_OPTION = {
  tres_per_node = "--gres/--gpus-per-node",
  tres_per_job = "--gpus",
  tres_per_task = "--gpus-per-task",
  tres_per_socket = "--gpus-per-socket",
}
local SLURM_NAME = "^[A-Za-z][A-Za-z0-9_%-]*$"

-- Resolved once at load: the module is loaded by path (dofile), so the chunk source is "@/dir/antman_job_submit.lua".
local function script_dir()
  local src = debug.getinfo(1, "S").source or ""
  if src:sub(1, 1) == "@" then src = src:sub(2) end
  return src:match("^(.*)/[^/]*$") or "."
end

local DIR = script_dir()
local SETTINGS_PATH = DIR .. "/antman_settings.lua"
local LOADER_PATH = DIR .. "/antman_settings_loader.lua"

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

-- antman_settings_loader.lua, loaded on first use and kept: chain() needs it, and so does every job.
local loader

local function shared()
  if loader == nil then
    local ok, l = pcall(dofile, LOADER_PATH)
    if not ok or type(l) ~= "table" or type(l.load) ~= "function" then
      return nil, string.format("cannot load %s (install it next to antman_job_submit.lua): %s", LOADER_PATH,
        ok and "it returned no loader" or tostring(l))
    end
    loader = l
  end
  return loader
end

local function load_settings()
  local l, err = shared()
  if not l then return nil, err end
  return l.load(SETTINGS_PATH, info)
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
-- the AdminComment tag (docs/protocol.md, "The AdminComment tag"; jobtag.py is the other side)

-- The value of the tag's last class field, or nil when the comment is no tag or has none. Lenient
-- on purpose: jobtag.py refuses a damaged tag, but the update guard must still treat one whose class
-- field says opportunistic as opportunistic.
local function tag_class(comment)
  if type(comment) ~= "string" or comment:sub(1, #TAG_PREFIX) ~= TAG_PREFIX then return nil end
  local class
  for field in (comment:sub(#TAG_PREFIX + 1) .. ";"):gmatch("([^;]*);") do
    local key, value = field:match("^([^=]*)=(.*)$")
    if key == "class" then class = value end
  end
  return class
end

-- The canonical tag of a job at submission: req only when the user asked for something else, then
-- elastic (a {MIN, MAX} pair, or nil) as jobtag.py's render() places it: after req and hold.
local function render_tag(class, request, elastic)
  local tag = TAG_PREFIX .. "class=" .. class
  if request ~= nil and request ~= class then tag = tag .. ";req=" .. request end
  if elastic ~= nil then tag = tag .. string.format(";elastic=%d:%d", elastic[1], elastic[2]) end
  return tag
end

-- MIN:MAX as {MIN, MAX}, or nil and what is wrong: two decimal numbers without sign, spaces or
-- leading zero, 1 <= MIN <= MAX <= 64 (the SPANK option's rule, spank/args.c; jobtag.py's for the tag).
local function parse_elastic(value)
  if type(value) ~= "string" then return nil, "not a string" end
  local lo, hi = value:match("^([1-9]%d?):([1-9]%d?)$")
  if lo == nil then return nil, "not MIN:MAX (two whole numbers, no sign, spaces or leading zero)" end
  lo, hi = tonumber(lo), tonumber(hi)
  if lo > hi then return nil, "MIN is larger than MAX" end
  if hi > ELASTIC_MAX_GPUS then return nil, string.format("MAX is over %d", ELASTIC_MAX_GPUS) end
  return { lo, hi }
end

---------------------------------------------------------------------------------------------
-- classification

-- The value of NAME=VALUE in job_desc.spank_job_env (the last one), or nil.
local function spank_env_value(env, name)
  if env == nil then return nil end
  if type(env) ~= "table" then error("job_desc.spank_job_env is a " .. type(env) .. ", expected a table") end
  local found
  -- 22.05 indexes this table from 0, so ipairs would miss the first entry
  for _, entry in pairs(env) do
    if type(entry) == "string" and entry:sub(1, #name + 1) == name .. "=" then
      found = entry:sub(#name + 2)
    end
  end
  return found
end

local function class_from_env(env)
  return spank_env_value(env, CLASS_ENV)
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

-- Whether -w names several nodes (sbatch sends a compressed list: "node[1,4]").
local function names_nodes(job_desc)
  local list = job_desc.req_nodes
  return type(list) == "string" and list:find("[,%[]") ~= nil
end

-- sbatch --spread-job (job_desc.bitflags, SPREAD_JOB in slurm.h: bit 8 from 22.05 to 25.11).
local SPREAD_JOB = 256

-- Whether the job said, one way or another, how many nodes it runs on: -N (min_nodes, max_nodes), a
-- task count over --ntasks-per-node (-n 4 --ntasks-per-node=2 is two nodes, with min_nodes unset), a
-- node list naming several (sbatch counts -w's nodes into min_nodes; the list is read too, for a client
-- that does not) or --spread-job.
local function chose_nodes(job_desc)
  if is_set(job_desc.max_nodes) or (is_set(job_desc.min_nodes) and job_desc.min_nodes ~= 1) then return true end
  local tasks, per_node = job_desc.num_tasks, job_desc.ntasks_per_node
  if is_set(tasks) and is_set(per_node, NO_VAL16) and tasks > per_node then return true end
  if names_nodes(job_desc) then return true end
  local flags = job_desc.bitflags
  return type(flags) == "number" and math.floor(flags / SPREAD_JOB) % 2 == 1
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

-- The GPU request as the user could have typed it, for messages: "--gres=gpu:5", "--gpus-per-task=gpu:2 x 3".
local function as_option(job_desc, field, e)
  local body = e.prefix and e.raw:sub(6) or e.raw
  if field == "tres_per_node" then return "--gres=" .. body end
  local text = TRES_OPTION[field] .. "=" .. body
  if field == "tres_per_task" or field == "tres_per_socket" then
    text = string.format("%s x %d", text, per_node_equivalent(job_desc, field, 1))
  end
  return text
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

-- The one GPU type of an opportunistic request (nil: untyped). Slots of several types cannot be placed
-- on one node (a node group has one type), and a type no node group has would never start.
local function one_gpu_type(types, s, asked)
  local seen, distinct = {}, {}
  for _, t in ipairs(types) do
    if not seen[t] then seen[t], distinct[#distinct + 1] = true, t end
  end
  if #distinct == 0 then return nil end
  local known = {}
  for t in pairs(s.gpu_types) do known[#known + 1] = t end
  table.sort(known)
  if #distinct > 1 then
    reject("an opportunistic job asks for GPUs of one type; this one asks for %s (%s)",
      table.concat(distinct, " and "), asked)
  end
  local t = distinct[1]
  if s.gpu_types[t] == nil then
    if #known == 0 then
      reject("no GPU node of this cluster has a declared type, so an opportunistic job cannot ask for type " ..
        "%s (%s); ask for --gres=%s:N", t, asked, s.gpu_gres)
    end
    reject("no GPU node of this cluster has type %s (%s); the types are: %s", t, asked, table.concat(known, ", "))
  end
  return t
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
  local opp_total, kept, types, asked = 0, {}, {}, {}
  local node_gpu, other_gpu_field = false, nil
  for _, e in ipairs(parse_tres(job_desc.tres_per_node, "tres_per_node")) do
    if e.name == s.gpu_gres then
      opp_total = opp_total + gpu_count(e, "tres_per_node")
      node_gpu = true
      if e.type then types[#types + 1] = e.type end
      asked[#asked + 1] = as_option(job_desc, "tres_per_node", e)
    elseif e.name == s.opp_gres then
      opp_total = opp_total + gpu_count(e, "tres_per_node")
      -- srun --antman=opportunistic outside an allocation: cli_filter already wrote opp_gres[:TYPE]:N
      if e.type then types[#types + 1] = e.type end
      asked[#asked + 1] = as_option(job_desc, "tres_per_node", e)
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
        asked[#asked + 1] = as_option(job_desc, field, e)
        if e.type then types[#types + 1] = e.type end
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
  local gpu_type = one_gpu_type(types, s, table.concat(asked, " "))
  -- Slurm itself would accept it (the opportunistic GRES counts slots, several per GPU) and the job
  -- would be requeued forever: no node can place more GPUs than it has.
  local most = gpu_type and s.gpu_types[gpu_type] or s.max_node_gpus
  if opp_total > most then
    local largest = gpu_type and string.format("the largest %s node has %d", gpu_type, most) or
      string.format("the largest node has %d", most)
    reject("an opportunistic job gets at most %d GPUs per node (%s); this one asks for " ..
      "%d (%s); ask for at most %d per node with --gres=%s:N, and -N for more nodes", most,
      largest, opp_total, table.concat(asked, " "), most, gpu_type and (s.gpu_gres .. ":" .. gpu_type) or s.gpu_gres)
  end
  -- On one node unless the job chose its nodes: its GPUs fit on one (checked above), and Slurm, left to
  -- itself, spreads a job whose tasks find no node with CPUs (or memory) enough free at the moment over
  -- several, each holding the per-node GPU count (--gres=gpu:2 -n 2 became 2 slots on each of 2 nodes):
  -- twice the GPUs asked for, and a job that waits for its node's bandwidth.
  if other_gpu_field or not chose_nodes(job_desc) then job_desc.max_nodes = 1 end
  -- The type stays on the slots: only nodes of that type offer opp_gres:TYPE, so Slurm places the job
  -- on one of them, as it would a guaranteed --gres=gpu:TYPE:N.
  kept[#kept + 1] = gpu_type and string.format("%s%s:%s:%d", prefix, s.opp_gres, gpu_type, opp_total) or
    string.format("%s%s:%d", prefix, s.opp_gres, opp_total)
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
  -- One leaf switch if Slurm can find it within the wait (topology/tree; without it Slurm ignores this):
  -- an opportunistic job spread over switches runs slower and has no deadline to trade that for. The
  -- user's own --switches stands, and a job that names its nodes asks nothing: nodes under two switches
  -- would only wait the whole wait, then run where they would have at once.
  if s.opp_switch_wait_s ~= nil and not is_set(job_desc.req_switch, NO_VAL) and not names_nodes(job_desc) then
    job_desc.req_switch = 1
    job_desc.wait4switch = s.opp_switch_wait_s
  end
  job_desc.admin_comment = render_tag("opportunistic")
  info("%s: class opportunistic; GPUs %s -> %s; partition %s -> %s%s", job_label(job_desc),
    table.concat(requested, " "), job_desc.tres_per_node,
    tostring(from_part or "(default)"), s.opp_partition, s.opp_qos and ("; qos " .. s.opp_qos) or "")
  return opp_total
end

local function make_guaranteed(job_desc, s)
  if has_partition(job_desc.partition, s.opp_partition) then
    reject("guaranteed jobs cannot use the %s partition, which holds opportunistic jobs; " ..
      "drop -p %s or submit with --antman=opportunistic", s.opp_partition, s.opp_partition)
  end
  forbid_opp_gres(job_desc, s, "guaranteed")
  job_desc.admin_comment = render_tag("guaranteed")
  info("%s: class guaranteed", job_label(job_desc))
end

-- Tenant quota use, written by the coordinator every cycle (antman_quota.lua next to this file:
-- return { as_of = 1767225600.25, accounts = { research = { quota = 4, used = 3 } } }). Slurm 22.05
-- cannot move a pending job's GRES request from gpu to the opportunistic GRES (the old request stays),
-- so auto must be resolved here, at submission.
local QUOTA_PATH = script_dir() .. "/antman_quota.lua"

local function load_quota()
  local chunk = loadfile(QUOTA_PATH)
  if not chunk then return nil end
  setfenv(chunk, {})
  local ok, q = pcall(chunk)
  if not ok or type(q) ~= "table" or type(q.accounts) ~= "table" then return nil end
  return q
end

-- The file's `used` comes from squeue read at as_of, so it lags by up to a coordinator cycle: six auto
-- jobs submitted within 25 ms all saw the same free quota and all became guaranteed. This table
-- remembers every guaranteed admission made here, { [account] = { [os.time() second] = GPUs } }, and
-- lives as long as slurmctld's Lua state (job_submit/lua keeps one state until this file changes or
-- slurmctld restarts; a new state forgets it, and the next quota file catches up within a cycle).
local admitted = {}
-- An admission in second t happened before t + 1. The snapshot may miss it unless t + 1 is earlier than
-- as_of by more than the clock skew between the coordinator's host and slurmctld's (antman doctor warns
-- from 2 s). Counting one twice only makes an auto job opportunistic, running at once in idle room;
-- missing one admits a guaranteed job over quota, which then waits held by the coordinator.
local ADMISSION_MARGIN_S = 5
-- A quota file without as_of (a coordinator from before it) lags by at most one cycle (cycle_s is at
-- most 60 s) plus the squeue call: every admission of the last 120 s is counted as not in it.
local NO_AS_OF_WINDOW_S = 120

-- The account the quota is kept for: -A, else the user's default account, as Slurm will choose it.
local function quota_account(job_desc)
  local a = job_desc.account
  if type(a) ~= "string" or a == "" then a = job_desc.default_account end
  if type(a) ~= "string" or a == "" then return nil end
  return a
end

-- GPUs a job holds against its tenant's quota, counted as the coordinator counts a pending job.
local function quota_gpus(job_desc, s)
  local n = 0
  for _, e in ipairs(parse_tres(job_desc.tres_per_node, "tres_per_node")) do
    if e.name == s.gpu_gres then n = n + (e.count or 1) end
  end
  return n
end

-- GPUs admitted to `account` that quota file q may not count yet; forgets every admission q counts.
local function admitted_since(q, account, now)
  local unseen
  if q ~= nil and type(q.as_of) == "number" then
    unseen = function(t) return t + 1 + ADMISSION_MARGIN_S > q.as_of end
  else
    unseen = function(t) return t > now - NO_AS_OF_WINDOW_S end
  end
  local total = 0
  for acct, seconds in pairs(admitted) do
    for t, gpus in pairs(seconds) do
      if not unseen(t) then
        seconds[t] = nil
      elseif acct == account then
        total = total + gpus
      end
    end
    if next(seconds) == nil then admitted[acct] = nil end
  end
  return total
end

local function record_admission(job_desc, s)
  local account, gpus = quota_account(job_desc), quota_gpus(job_desc, s)
  local now = os.time()
  admitted_since(load_quota(), nil, now) -- prunes, so a site without auto jobs keeps the table small
  if account == nil or gpus == 0 then return end
  local seconds = admitted[account] or {}
  admitted[account] = seconds
  seconds[now] = (seconds[now] or 0) + gpus
end

local function resolve_auto(job_desc, s)
  local q = load_quota()
  if q == nil then return s.auto_class, "no quota file from the coordinator; site auto_class" end
  local account = quota_account(job_desc)
  local t = account and q.accounts[account] or nil
  if t == nil or type(t.quota) ~= "number" or type(t.used) ~= "number" then
    return s.auto_class, string.format("account %s has no quota entry; site auto_class", tostring(account))
  end
  local want = quota_gpus(job_desc, s)
  if want == 0 then want = 1 end
  local recent = admitted_since(q, account, os.time())
  local used = t.used + recent
  local counted = string.format("%d of %d GPUs in use (%d in the coordinator's count, %d admitted since)",
    used, t.quota, t.used, recent)
  if used + want <= t.quota then
    return "guaranteed", string.format("tenant %s: %s, needs %d", account, counted, want)
  end
  return "opportunistic", string.format("tenant %s over quota: %s, needs %d", account, counted, want)
end

-- Slurm runs this once per component of a heterogeneous job, each a job record of its own that Slurm
-- starts and requeues together with the others; quotas, placement and preemption here treat every
-- record as a whole job, so one component's preemption would take the others down unannounced.
local function forbid_het(job_desc, requested, class)
  local offset = job_desc.het_job_offset
  if type(offset) ~= "number" or offset == NO_VAL then return end
  local way = requested and "submit the components as separate jobs or without --antman" or
    string.format("submit the components as separate jobs (this site makes GPU jobs %s by default)", class)
  reject("heterogeneous jobs are not supported by slurm-antman (component %d of a --het-group/':' job); %s",
    offset, way)
end

---------------------------------------------------------------------------------------------
-- elastic width (--antman-elastic=MIN:MAX; docs/elastic.md)

local ELASTIC_OPTION = "--antman-elastic"

-- Whether the job may run on more than one node: -N above 1 (min or max), -w naming several nodes,
-- more tasks than --ntasks-per-node, or --spread-job.
local function may_span_nodes(job_desc)
  local mn, mx = job_desc.min_nodes, job_desc.max_nodes
  if (is_set(mn) and mn > 1) or (is_set(mx) and mx > 1) or names_nodes(job_desc) then return true end
  local tasks, per_node = job_desc.num_tasks, job_desc.ntasks_per_node
  if is_set(tasks) and is_set(per_node, NO_VAL16) and tasks > per_node then return true end
  local flags = job_desc.bitflags
  return type(flags) == "number" and math.floor(flags / SPREAD_JOB) % 2 == 1
end

-- The GPUs per node the job asks for, counted as make_opportunistic counts them (the job is on one
-- node, so --gpus, --gpus-per-task and --gpus-per-socket are per node too). Refuses a request whose
-- count cannot be read.
local function elastic_node_gpus(job_desc, s, value)
  local total, asked = 0, {}
  for _, field in ipairs(TRES_FIELDS) do
    for _, e in ipairs(parse_tres(job_desc[field], field)) do
      if e.name == s.gpu_gres or e.name == s.opp_gres then
        if e.count == nil then
          reject("%s=%s: cannot read the GPU count in %s request %q, so MAX cannot be checked against it; " ..
            "ask for the GPUs with --gres=%s:MAX", ELASTIC_OPTION, value, TRES_OPTION[field], e.raw, s.gpu_gres)
        end
        local n = field == "tres_per_node" and e.count or per_node_equivalent(job_desc, field, e.count)
        total = total + n
        asked[#asked + 1] = as_option(job_desc, field, e)
      end
    end
  end
  return total, table.concat(asked, " ")
end

-- The tasks of a job array (job_desc.array_inx, the --array value as sbatch sends it, throttle
-- included: "0-3", "0,2,4", "0-7:2", "0-3%2"): how many distinct indices it names (counted up to
-- ELASTIC_MAX_GPUS + 1: more can never fit an elastic range) and the throttle text ("%2", nil without
-- one); or nil and why it cannot be read. The grammar is sbatch's: INDEX, A-B or A-B:STEP, comma
-- separated, then an optional %N.
local function array_tasks(inx)
  local list, throttle = inx:match("^([^%%]*)(%%%d+)$")
  if list == nil then
    if inx:find("%", 1, true) then return nil, "the throttle after % is not a whole number" end
    list = inx
  end
  local seen, n = {}, 0
  for item in (list .. ","):gmatch("([^,]*),") do
    local a, b, step = item:match("^(%d+)%-(%d+):(%d+)$")
    if a == nil then
      a, b = item:match("^(%d+)%-(%d+)$")
      a, step = a or item:match("^(%d+)$"), "1"
      b = b or a
    end
    if a == nil then return nil, string.format("%q is not N, A-B or A-B:STEP", item) end
    a, b, step = tonumber(a), tonumber(b), tonumber(step)
    if b < a or step < 1 then return nil, string.format("%q names no task", item) end
    for i = a, b, step do
      if not seen[i] then seen[i], n = true, n + 1 end
      if n > ELASTIC_MAX_GPUS then return n, throttle end
    end
  end
  return n, throttle
end

-- The elastic range of a job array's task: {MIN, MAX} and the GPUs each task asks for, `gpus` (G).
-- MAX == G: each task is an elastic job of its own, on its node. MAX == K x G for the array's K > 1
-- tasks: one training across the tasks' nodes, whose width changes a node (G GPUs) at a time (a shed
-- is the requeue of one task, a grow Slurm starting a pending one), so MIN is a multiple of G and the
-- coordinator owns ArrayTaskThrottle; returns K. Anything else is refused, naming both readings.
local function elastic_array(job_desc, value, range, gpus, asked)
  local inx = job_desc.array_inx
  local k, throttle = array_tasks(inx)
  if k == nil then
    reject("%s=%s: cannot read the task count of --array=%s (%s), so MAX cannot be checked against it; " ..
      "give the tasks as N, A-B or A-B:STEP, comma separated", ELASTIC_OPTION, value, inx, throttle)
  end
  if may_span_nodes(job_desc) then
    reject("%s=%s with --array=%s: each task of an elastic job array runs on one node; drop -N, -w with " ..
      "several nodes, --spread-job or the task count that needs several nodes", ELASTIC_OPTION, value, inx)
  end
  local lo, hi = range[1], range[2]
  if hi == gpus then return nil end -- a sweep: each task its own one-node elastic job
  local many = k > ELASTIC_MAX_GPUS
  local tasks = string.format("%s with --array=%s (%s%d task%s) and %s per task", value, inx,
    many and "over " or "", many and ELASTIC_MAX_GPUS or k, k == 1 and "" or "s", asked)
  if k > 1 and hi == k * gpus then
    if lo % gpus ~= 0 then
      reject("%s=%s: one job across the %d tasks' nodes changes its width a node (%d GPU%s) at a time, so " ..
        "MIN must be a multiple of %d (%s=%d:%d, for one)", ELASTIC_OPTION, tasks, k, gpus, gpus == 1 and "" or "s",
        gpus, ELASTIC_OPTION, math.max(gpus, lo - lo % gpus), hi)
    end
    if throttle ~= nil then
      reject("%s=%s: drop the throttle %s; for one job across the tasks' nodes slurm-antman sets the " ..
        "array's task throttle itself (it is the job's width in nodes)", ELASTIC_OPTION, tasks, throttle)
    end
    return k
  end
  local own = string.format("MAX must be %d (each task its own elastic job)", gpus)
  if k == 1 then
    reject("%s=%s: %s; one job across nodes needs an array of several tasks", ELASTIC_OPTION, tasks, own)
  elseif many or k * gpus > ELASTIC_MAX_GPUS then
    reject("%s=%s: %s; one job across the tasks' nodes would need MAX = %s x %d, over the limit of %d",
      ELASTIC_OPTION, tasks, own, many and "tasks" or tostring(k), gpus, ELASTIC_MAX_GPUS)
  end
  reject("%s=%s: %s or %d (one job across the %d tasks' nodes, MIN a multiple of %d)", ELASTIC_OPTION, tasks,
    own, k * gpus, k, gpus)
end

-- The elastic range the job asked for, checked against the rest of the request; nil when it asked
-- for none. `requested` is the class the user named (nil: no --antman). Also returns the GPUs per node
-- (per task) the job asks for, and for one job across the nodes of an array the number of its tasks
-- (nil otherwise).
local function elastic_request(job_desc, s, requested)
  local value = spank_env_value(job_desc.spank_job_env, ELASTIC_ENV)
  if value == nil then return nil end
  if requested == "guaranteed" then
    reject("%s is only for --antman=opportunistic or --antman=auto: a guaranteed job keeps the GPUs it " ..
      "asked for, its width is its own; drop %s or submit with --antman=opportunistic", ELASTIC_OPTION, ELASTIC_OPTION)
  end
  if requested ~= "opportunistic" and requested ~= "auto" then
    reject("%s is only for --antman=opportunistic or --antman=auto (this job names no class); add " ..
      "--antman=opportunistic", ELASTIC_OPTION)
  end
  local range, why = parse_elastic(value)
  if range == nil then
    reject("%s: invalid value %q (%s); allowed: MIN:MAX, two whole numbers with 1 <= MIN <= MAX <= %d, " ..
      "MAX being the GPUs per node the job asks for (--gres=%s:MAX)", ELASTIC_OPTION, value, why,
      ELASTIC_MAX_GPUS, s.gpu_gres)
  end
  local array = job_desc.array_inx ~= nil and job_desc.array_inx ~= ""
  if not array and may_span_nodes(job_desc) then
    reject("%s=%s: an elastic job runs on one node; for one job across K nodes, submit it as a job array " ..
      "of one-node tasks: --array=0-(K-1) with --gres=%s:G per task and %s=MIN:MAX, MAX = K x G, MIN a " ..
      "multiple of G (docs/elastic.md, \"Across nodes: a job array\")", ELASTIC_OPTION, value, s.gpu_gres,
      ELASTIC_OPTION)
  end
  local gpus, asked = elastic_node_gpus(job_desc, s, value)
  if gpus == 0 then
    reject("%s=%s: the job asks for no GPU; ask for MAX of them with --gres=%s:%d", ELASTIC_OPTION, value,
      s.gpu_gres, range[2])
  end
  if array then return range, gpus, elastic_array(job_desc, value, range, gpus, asked) end
  if gpus ~= range[2] then
    reject("%s=%s: MAX must equal the GPUs per node the job asks for, %d (%s); use --gres=%s:%d with it, " ..
      "or %s=%d:%d", ELASTIC_OPTION, value, gpus, asked, s.gpu_gres, range[2], ELASTIC_OPTION,
      math.min(range[1], gpus), gpus)
  end
  return range, gpus
end

---------------------------------------------------------------------------------------------

local function classify(job_desc, s)
  local requested = class_from_env(job_desc.spank_job_env)
  local class = requested
  if class == nil then
    class = s.default_class
    if class ~= "none" and not requests_gpu(job_desc, s) then class = "none" end
  elseif class ~= "auto" and class ~= "guaranteed" and class ~= "opportunistic" then
    reject("unknown class %q in ANTMAN_CLASS; allowed: guaranteed, opportunistic, auto", class)
  end
  -- before auto is resolved, so that the same request is accepted or refused whatever the quota says
  local elastic, elastic_gpus, elastic_tasks = elastic_request(job_desc, s, requested)
  if class == "none" then
    forbid_opp_gres(job_desc, s, "none")
    return
  end
  forbid_het(job_desc, requested, class)
  if class == "auto" then
    local why
    class, why = resolve_auto(job_desc, s)
    info("%s: class auto resolved to %s (%s)", job_label(job_desc), class, why)
  end
  if class == "guaranteed" then
    make_guaranteed(job_desc, s)
    -- explicit guaranteed jobs take quota too: an auto job right after one must see it
    record_admission(job_desc, s)
    if elastic ~= nil then
      -- only auto gets here: a guaranteed job's width is its own
      info("%s: %s=%d:%d dropped, the job is guaranteed", job_label(job_desc), ELASTIC_OPTION, elastic[1], elastic[2])
      elastic = nil
    end
  else
    local gpus = make_opportunistic(job_desc, s)
    if elastic ~= nil then
      -- elastic_request counted the same request; a difference is a bug here, not the user's
      if gpus ~= elastic_gpus then
        error(string.format("elastic range counted %d GPUs per node but %d after the rewrite", elastic_gpus, gpus))
      end
      job_desc.max_nodes = 1
      if elastic_tasks ~= nil then
        info("%s: elastic width %d to %d GPUs across the nodes of the %d tasks of --array=%s (%d GPU%s each)",
          job_label(job_desc), elastic[1], elastic[2], elastic_tasks, job_desc.array_inx, gpus, gpus == 1 and "" or "s")
      else
        info("%s: elastic width %d to %d GPUs", job_label(job_desc), elastic[1], elastic[2])
      end
    end
  end
  -- the coordinator resolves auto by tenant quota; it must know the user left the choice open
  job_desc.admin_comment = render_tag(class, requested, elastic)
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

local M = {}

-- For tests/test_contracts.py, which holds them to docs/contracts.json.
M.tag_class, M.render_tag, M.parse_elastic = tag_class, render_tag, parse_elastic

-- The policy for one submission: slurm.SUCCESS, or an error code with the reason told to the user.
function M.job_submit(job_desc, part_list, submit_uid)
  return guarded(safe_label(job_label, job_desc), false, function()
    classify(job_desc, settings_or_reject())
  end)
end

local function check_modify(job_desc, job_rec, modify_uid)
  local class = tag_class(job_rec.admin_comment)
  -- only opportunistic jobs are guarded, so a broken settings file does not block updates
  -- (hold, release, time limits) of every other job
  if class ~= "opportunistic" then return end
  local s = settings_or_reject()
  if modify_uid == 0 and tag_class(job_desc.admin_comment) == "guaranteed" then
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

-- The policy for one update (scontrol update, by a user or the coordinator).
function M.job_modify(job_desc, job_rec, part_list, modify_uid)
  local label = safe_label(function() return "update of job " .. tostring(job_rec.job_id) end)
  return guarded(label, true, function()
    check_modify(job_desc, job_rec, modify_uid)
  end)
end

---------------------------------------------------------------------------------------------
-- chain(): the site's job_submit.lua first, then the policy

-- The site's own function, as Slurm would run it: its return code (a non-number counts as success, as
-- job_submit/lua reads it), or an error code when it raised.
local function run_site(name, fn, for_modify, label, ...)
  if fn == nil then return slurm.SUCCESS end
  local ok, rc = pcall(fn, ...)
  if not ok then
    slurm.log_error("%s", string.format("slurm-antman: the site's %s raised an error for %s: %s; rejected", name,
      label, tostring(rc)))
    if not for_modify then
      slurm.log_user("%s", "job_submit.lua failed on this job (an error in the site's own rules); job rejected, " ..
        "contact your admin")
    end
    return slurm.ERROR
  end
  return tonumber(rc) or slurm.SUCCESS
end

-- Makes the globals Slurm calls run the site's functions, then the policy. The site's functions are
-- taken whether they were defined before this call or after it (antman_settings_loader.lua's chain),
-- so the line may stand anywhere at the top level of the site's script.
function M.chain()
  local l, err = shared()
  if not l or type(l.chain) ~= "function" then
    -- Fail closed, but keep job_submit.lua loadable: a script that does not load is fatal when slurmctld
    -- starts, which would stop the whole cluster for one missing file. The policy runs alone (it rejects
    -- every job naming the loader), and a site function defined after this line is dropped rather than
    -- allowed to replace it and let jobs through unclassified.
    slurm.log_error("%s", "slurm-antman: " .. (err or (LOADER_PATH .. " has no chain(); install the one of " ..
      "this release")) .. "; the site's rules are not chained and every job is rejected")
    local hooks = { slurm_job_submit = M.job_submit, slurm_job_modify = M.job_modify }
    for name in pairs(hooks) do rawset(_G, name, nil) end
    local mt = getmetatable(_G) or {}
    local prev_index, prev_newindex = mt.__index, mt.__newindex
    mt.__index = function(t, k)
      if hooks[k] then return hooks[k] end
      if type(prev_index) == "function" then return prev_index(t, k) end
      if type(prev_index) == "table" then return prev_index[k] end
    end
    mt.__newindex = function(t, k, v)
      if hooks[k] then return end
      if type(prev_newindex) == "function" then return prev_newindex(t, k, v) end
      rawset(t, k, v)
    end
    setmetatable(_G, mt)
    return M
  end
  local site
  local entry = {}
  function entry.slurm_job_submit(job_desc, part_list, submit_uid)
    local label = safe_label(job_label, job_desc)
    local rc = run_site("slurm_job_submit", site.slurm_job_submit, false, label, job_desc, part_list, submit_uid)
    if rc ~= slurm.SUCCESS then return rc end
    return M.job_submit(job_desc, part_list, submit_uid)
  end
  function entry.slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
    local label = safe_label(function() return "update of job " .. tostring(job_rec.job_id) end)
    local rc = run_site("slurm_job_modify", site.slurm_job_modify, true, label, job_desc, job_rec, part_list,
      modify_uid)
    if rc ~= slurm.SUCCESS then return rc end
    return M.job_modify(job_desc, job_rec, part_list, modify_uid)
  end
  site = l.chain("antman_job_submit_chained", entry)
  if site == nil then
    info("chain() called again; the first call already chains the site's functions")
    return M
  end
  info("job_submit.lua chained: the site's rules (%s), then slurm-antman's; settings from %s",
    (site.slurm_job_submit or site.slurm_job_modify) and "defined before the line" or "none yet", SETTINGS_PATH)
  return M
end

return M
