-- POST a grade request to /grade/<grader> for one of <rollouts> seeded rollouts.
--   wrk -s bench/wrk/grade.lua URL -- <nonce> <grader> <rollouts> <api key> [<run tag>]
-- The trace ids are the ones bench/grading.py seeded with tool calls (trace_<nonce>_<i>). Every
-- request's answer is new (run tag and counter in it; the reference is the same text, so string checks
-- pass): as in training, where answers repeat rarely, the stored grades do not pile up on one answer.
-- done() prints one line "BENCH_JSON {...}" that bench/grading.py reads.

local counter = 0
local nonce, rollouts, path, tag

function init(args)
  nonce = args[1] or "n"
  rollouts = tonumber(args[3] or "16")
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
  if args[4] ~= nil and args[4] ~= "" then
    wrk.headers["Authorization"] = "Bearer " .. args[4]
  end
  path = "/grade/" .. (args[2] or "exact")
  tag = args[5] or "r"
end

function request()
  counter = counter + 1
  local rollout = counter % rollouts
  local answer = string.format("The total is 1,234.50 for order #W%d (ref %s-%d)", rollout, tag, counter)
  local body = string.format(
    '{"sample":{"output_text":"%s","choices":[]},' ..
      '"item":{"id":"row_%d","reference_answer":"%s"},' ..
      '"trace_id":"trace_%s_%d"}',
    answer, rollout, answer, nonce, rollout
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
