-- wrk script for the proxies section of tests/bench/proxy.rs: the small non-streaming chat
-- request, the same for every path.
wrk.method = "POST"
wrk.body = '{"messages":[{"role":"user","content":"hi"}],"max_tokens":1}'
wrk.headers["Content-Type"] = "application/json"
