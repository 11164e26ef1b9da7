-- POST an MCP tools/call (JSON-RPC, Streamable HTTP, protocol 2025-11-25) to /mcp, a new call each time.
--   wrk -s bench/wrk/mcp.lua URL -- <nonce> <tool> <rollouts> <api key>
-- The same load as post.lua, over MCP: each request has a unique JSON-RPC id (nonce, thread, counter),
-- so the ledger never replays one, and an Mcp-Session-Id cycling through <rollouts> sessions (each
-- session is a rollout, trace_mcp_<session>). done() prints the BENCH_JSON line bench/run.py reads.

local thread_count = 0

function setup(thread)
  thread_count = thread_count + 1
  thread:set("tid", thread_count)
end

local counter = 0
local nonce, tool, rollouts, key

function init(args)
  nonce = args[1] or "n"
  tool = args[2] or "echo"
  rollouts = tonumber(args[3] or "16")
  key = args[4] or ""
end

function request()
  counter = counter + 1
  local rollout = counter % rollouts
  local headers = {
    ["Content-Type"] = "application/json",
    ["Accept"] = "application/json, text/event-stream",
    ["MCP-Protocol-Version"] = "2025-11-25",
    ["Mcp-Session-Id"] = string.format("%s_%d", nonce, rollout),
  }
  if key ~= "" then
    headers["Authorization"] = "Bearer " .. key
  end
  local body = string.format(
    '{"jsonrpc":"2.0","id":"%s_%d_%d","method":"tools/call",' ..
      '"params":{"name":"%s","arguments":{"text":"hello %d"}}}',
    nonce, tid, counter, tool, counter
  )
  return wrk.format("POST", "/mcp", headers, body)
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
