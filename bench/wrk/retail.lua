-- POST a retail pack call to /tools/<tool>, a new call each time, as a training job would send it.
--   wrk -s bench/wrk/retail.lua URL -- <nonce> <tool> <rollouts> <api key> <ids file>
-- <tool> is get_order_details (a read: one order id per line of <ids file>) or modify_user_address
-- (a write: one user id per line). Every request has a unique call_id (nonce, thread, counter), and a
-- trace_id cycling through <rollouts> rollouts. done() prints "BENCH_JSON {...}" for bench/run.py.

local thread_count = 0

function setup(thread)
  thread_count = thread_count + 1
  thread:set("tid", thread_count)
end

local counter = 0
local nonce, tool, rollouts, path
local ids = {}

function init(args)
  nonce = args[1] or "n"
  tool = args[2] or "get_order_details"
  rollouts = tonumber(args[3] or "500")
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
  if args[4] ~= nil and args[4] ~= "" then
    wrk.headers["Authorization"] = "Bearer " .. args[4]
  end
  for line in io.lines(args[5]) do
    if line ~= "" then ids[#ids + 1] = line end
  end
  path = "/tools/" .. tool
end

local function arguments(n)
  local id = ids[(n % #ids) + 1]
  if tool == "modify_user_address" then
    return string.format(
      '{\\"user_id\\":\\"%s\\",\\"address1\\":\\"%d Elm Street\\",\\"address2\\":\\"Suite %d\\",' ..
        '\\"city\\":\\"Austin\\",\\"state\\":\\"TX\\",\\"country\\":\\"USA\\",\\"zip\\":\\"78701\\"}',
      id, n, tid
    )
  end
  return string.format('{\\"order_id\\":\\"%s\\"}', id)
end

function request()
  counter = counter + 1
  local rollout = counter % rollouts
  local body = string.format(
    '{"type":"function_call","id":"fc_%s_%d_%d","call_id":"call_%s_%d_%d","name":"%s",' ..
      '"arguments":"%s","trace_id":"trace_%s_%d","item":{"id":"row_%d"}}',
    nonce, tid, counter, nonce, tid, counter, tool, arguments(counter), nonce, rollout, rollout
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
