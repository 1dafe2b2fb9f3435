"""anthropic_client.py BASE_URL MODE TIMEOUT [API_KEY] - one request through the official
`anthropic` package, as an application sends it, with a timeout of TIMEOUT s and no retry.
BASE_URL is the server's root, e.g. http://127.0.0.1:8080 (the package adds /v1/messages).
MODE is one of, each asking "hello" or, after a colon, the text of a file (plain:FILE):
    plain         messages.create(...)
    stream        messages.create(stream=True, ...), every event read
    helper        messages.stream(...), the package's stream helper, which builds the message
                  from the events (it refuses one that does not open with message_start); every
                  event read, then its final message (its input tokens in "input_tokens")
    count_tokens  messages.count_tokens(...)
API_KEY goes in x-api-key (default "none").

Prints one line of JSON and exits 0 when the answer came whole:
    {"text": "...", "stop_reason": "...", "events": [TYPE, ...]}   (plain, stream)
    {"input_tokens": N}                                            (count_tokens)
or exits 1 when the package raised one of its errors (APIStatusError and its subclasses for
an error answer or an error event, APIConnectionError, APITimeoutError):
    {"error": "CLASS", "message": "...", "status": N or null, "body": ...}
Exits 2 on a usage error or when the anthropic package is missing (tests/clients/prepare makes
a venv that has it).
"""

import json
import sys


def jsonable(v):
    try:
        return json.loads(json.dumps(v))
    except (TypeError, ValueError):
        return repr(v)


def main():
    mode, _, prompt_file = sys.argv[2].partition(":") if len(sys.argv) > 2 else ("", "", "")
    if len(sys.argv) not in (4, 5) or mode not in ("plain", "stream", "helper", "count_tokens"):
        print(f"usage: {sys.argv[0]} BASE_URL plain|stream|helper|count_tokens[:FILE] TIMEOUT "
              "[API_KEY]", file=sys.stderr)
        sys.exit(2)
    base_url, timeout = sys.argv[1], float(sys.argv[3])
    prompt = "hello"
    if prompt_file:
        with open(prompt_file) as f:
            prompt = f.read()
    api_key = sys.argv[4] if len(sys.argv) == 5 else "none"
    try:
        import anthropic
    except ImportError as e:
        print(f"anthropic_client: {sys.executable} has no anthropic package ({e})",
              file=sys.stderr)
        sys.exit(2)
    client = anthropic.Anthropic(base_url=base_url, api_key=api_key, timeout=timeout,
                                 max_retries=0)
    request = {"model": "dsv4", "max_tokens": 8,
               "messages": [{"role": "user", "content": prompt}]}
    try:
        if mode == "count_tokens":
            del request["max_tokens"]
            out = {"input_tokens": client.messages.count_tokens(**request).input_tokens}
        elif mode == "plain":
            m = client.messages.create(**request)
            out = {"text": "".join(b.text for b in m.content if b.type == "text"),
                   "stop_reason": m.stop_reason, "events": []}
        elif mode == "helper":
            events = []
            with client.messages.stream(**request) as stream:
                for event in stream:
                    events.append(event.type)
                m = stream.get_final_message()
            out = {"text": "".join(b.text for b in m.content if b.type == "text"),
                   "stop_reason": m.stop_reason, "events": events,
                   "input_tokens": m.usage.input_tokens}
        else:
            text, stop, events = [], None, []
            for event in client.messages.create(stream=True, **request):
                events.append(event.type)
                if event.type == "content_block_delta" and event.delta.type == "text_delta":
                    text.append(event.delta.text)
                elif event.type == "message_delta":
                    stop = event.delta.stop_reason
            out = {"text": "".join(text), "stop_reason": stop, "events": events}
    except anthropic.APIError as e:
        print(json.dumps({"error": type(e).__name__, "message": e.message,
                          "status": getattr(e, "status_code", None),
                          "body": jsonable(e.body)}))
        sys.exit(1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
