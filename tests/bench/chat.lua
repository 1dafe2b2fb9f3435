-- wrk script for the proxies section of tests/bench/proxies.rs: the same chat request for
-- every path, its body from DSV4_BENCH_BODY (a small non-streaming chat, or a streamed one).
wrk.method = "POST"
wrk.body = os.getenv("DSV4_BENCH_BODY") or '{"messages":[{"role":"user","content":"hi"}],"max_tokens":1}'
wrk.headers["Content-Type"] = "application/json"
-- The engine's key (it answers 401 without it); dsv4d sends the same in place of the client's.
local authorization = os.getenv("DSV4_BENCH_AUTHORIZATION")
if authorization then
  wrk.headers["Authorization"] = authorization
end
