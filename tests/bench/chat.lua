-- wrk script for the proxies section of tests/bench/proxy.rs: the small non-streaming chat
-- request, the same for every path.
wrk.method = "POST"
wrk.body = '{"messages":[{"role":"user","content":"hi"}],"max_tokens":1}'
wrk.headers["Content-Type"] = "application/json"
-- The engine's key (it answers 401 without it); dsv4d sends the same in place of the client's.
local authorization = os.getenv("DSV4_BENCH_AUTHORIZATION")
if authorization then
  wrk.headers["Authorization"] = authorization
end
