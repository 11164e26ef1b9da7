-- POST a Responses function_call item to /tools/<tool>, a new call each time.
--   wrk -s bench/wrk/post.lua URL -- <nonce> <tool> <rollouts> <api key>
-- Every request has a unique call_id (nonce, thread, counter) so the ledger never replays one, and a
-- trace_id cycling through <rollouts> distinct rollouts (parallel calls of one rollout do happen).
-- done() prints one line "BENCH_JSON {...}" that bench/run.py reads.

local thread_count = 0

function setup(thread)
  thread_count = thread_count + 1
  thread:set("tid", thread_count)
end

local counter = 0
local nonce, tool, rollouts, path

function init(args)
  nonce = args[1] or "n"
  tool = args[2] or "echo"
  rollouts = tonumber(args[3] or "16")
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
  if args[4] ~= nil and args[4] ~= "" then
    wrk.headers["Authorization"] = "Bearer " .. args[4]
  end
  path = "/tools/" .. tool
end

function request()
  counter = counter + 1
  local rollout = counter % rollouts
  local body = string.format(
    '{"type":"function_call","id":"fc_%s_%d_%d","call_id":"call_%s_%d_%d","name":"%s",' ..
      '"arguments":"{\\"text\\":\\"hello %d\\"}","trace_id":"trace_%s_%d","item":{"id":"row_%d"}}',
    nonce, tid, counter, nonce, tid, counter, tool, counter, nonce, rollout, rollout
  )
  return wrk.format(nil, path, nil, body)
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH_JSON {"requests":%d,"duration_us":%d,"bytes":%d,' ..
      '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},' ..
      '"latency_us":{"p50":%d,"p90":%d,"p99":%d,"max":%d,"mean":%.1f}}\n',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max, latency.mean
  ))
end
