"""openai_stream.py BASE_URL REQUEST_FILE [TIMEOUT] - one streamed chat through the official
`openai` package, as an application sends it: `chat.completions.create(stream=True, **REQUEST)`
with REQUEST read from the JSON file REQUEST_FILE, a timeout of TIMEOUT s (default 5: the
longest the package waits for a byte) and no retry. BASE_URL is the API root, e.g.
http://127.0.0.1:8080/v1.

Prints one line of JSON and exits 0 when the stream came whole:
    {"content": "...", "reasoning": ["...", ...], "chunks": N, "finish_reason": "..."}
where reasoning holds the `reasoning_content` deltas, in order, as the package gives them
(`delta.reasoning_content`, a field OpenAI's own types do not name);
or exits 1 when the package raised one of its errors (APIError for an error event in the stream,
APITimeoutError for a silence longer than the timeout, BadRequestError for a 400, ...):
    {"error": "APIError", "message": "...", "body": ...}
Exits 2 on a usage error or when the openai package is missing (tests/clients/prepare makes a
venv that has it).
"""

import json
import sys


def main():
    if len(sys.argv) not in (3, 4):
        print(f"usage: {sys.argv[0]} BASE_URL REQUEST_FILE [TIMEOUT]", file=sys.stderr)
        sys.exit(2)
    base_url = sys.argv[1]
    with open(sys.argv[2]) as f:
        request = json.load(f)
    timeout = float(sys.argv[3]) if len(sys.argv) == 4 else 5.0
    # dsv4d and its engines serve whatever model is asked for.
    request.setdefault("model", "dsv4")
    try:
        import openai
    except ImportError as e:
        print(f"openai_stream: {sys.executable} has no openai package ({e})", file=sys.stderr)
        sys.exit(2)
    client = openai.OpenAI(base_url=base_url, api_key="none", timeout=timeout, max_retries=0)
    content, reasoning, chunks, finish = [], [], 0, None
    try:
        for chunk in client.chat.completions.create(stream=True, **request):
            chunks += 1
            for choice in chunk.choices or []:
                if choice.delta and choice.delta.content:
                    content.append(choice.delta.content)
                thought = getattr(choice.delta, "reasoning_content", None)
                if thought:
                    reasoning.append(thought)
                if choice.finish_reason:
                    finish = choice.finish_reason
    except openai.APIError as e:
        try:
            body = json.loads(json.dumps(e.body))
        except (TypeError, ValueError):
            body = repr(e.body)
        print(json.dumps({"error": type(e).__name__, "message": e.message, "body": body}))
        sys.exit(1)
    print(json.dumps({"content": "".join(content), "reasoning": reasoning, "chunks": chunks,
                      "finish_reason": finish}))


if __name__ == "__main__":
    main()
