//! A request of Anthropic's Messages API or OpenAI's Responses API as the chat llama-server
//! makes of it before it renders its prompt (`server_chat_convert_anthropic_to_oai` and
//! `server_chat_convert_responses_to_chatcmpl` in its `tools/server/server-chat.cpp`, as
//! vendored by llama-cpp-python 0.3.36), so that `/apply-template` renders the prompt the
//! engine served: a restore is checked by the agents' requests too (Claude Code speaks
//! Messages, Codex speaks Responses).
//!
//! Only what reaches the rendered prompt matters here: the messages, the tools, the tool
//! choice and the template's own arguments. A request the engine itself refuses is an
//! error here too, and checks nothing.

use serde_json::{json, Map, Value};

/// A `/v1/messages` body as llama-server's chat.
pub fn anthropic(body: &Value) -> Result<Value, String> {
    let mut messages = Vec::new();
    match body.get("system") {
        None | Some(Value::Null) => {}
        Some(system) => {
            let text = match system {
                Value::String(s) => billing_normalized(s),
                Value::Array(blocks) => blocks
                    .iter()
                    .filter(|b| b["type"] == "text")
                    .map(|b| billing_normalized(b["text"].as_str().unwrap_or_default()))
                    .collect(),
                _ => String::new(),
            };
            messages.push(json!({"role": "system", "content": text}));
        }
    }
    let asked = body.get("messages").ok_or("'messages' is required")?;
    for msg in asked.as_array().into_iter().flatten() {
        anthropic_message(msg, &mut messages);
    }
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages));
    if let Some(tools) = body.get("tools").and_then(Value::as_array) {
        let tools = tools
            .iter()
            .map(|t| {
                json!({"type": "function", "function": {
                    "name": t["name"].as_str().unwrap_or_default(),
                    "description": t["description"].as_str().unwrap_or_default(),
                    "parameters": t.get("input_schema").cloned().unwrap_or_else(|| json!({})),
                }})
            })
            .collect();
        chat.insert("tools".into(), Value::Array(tools));
    }
    match body["tool_choice"]["type"].as_str() {
        Some("auto") => _ = chat.insert("tool_choice".into(), "auto".into()),
        Some("any" | "tool") => _ = chat.insert("tool_choice".into(), "required".into()),
        _ => {}
    }
    for key in ["chat_template_kwargs", "stream"] {
        if let Some(v) = body.get(key) {
            chat.insert(key.into(), v.clone());
        }
    }
    if body["thinking"]["type"] == "enabled" {
        let budget = body["thinking"]["budget_tokens"].as_i64().unwrap_or(10_000);
        chat.insert("thinking_budget_tokens".into(), budget.into());
    }
    Ok(Value::Object(chat))
}

/// One Anthropic message as the chat's messages: its own (text, thinking, images and tool
/// calls), then a tool message per tool result it carries.
fn anthropic_message(msg: &Value, messages: &mut Vec<Value>) {
    let role = msg["role"].as_str().unwrap_or_default();
    let blocks = match msg.get("content") {
        None if role == "assistant" => return,
        Some(Value::Array(blocks)) => blocks,
        _ => return messages.push(msg.clone()),
    };
    let (mut content, mut calls, mut results, mut reasoning) =
        (Vec::new(), Vec::new(), Vec::new(), String::new());
    for block in blocks {
        match block["type"].as_str().unwrap_or_default() {
            "text" => content.push(block.clone()),
            "thinking" => reasoning.push_str(block["thinking"].as_str().unwrap_or_default()),
            "image" => content.extend(image_part(&block["source"])),
            "tool_use" => calls.push(json!({
                "id": block["id"].as_str().unwrap_or_default(),
                "type": "function",
                "function": {
                    "name": block["name"].as_str().unwrap_or_default(),
                    "arguments": block.get("input").unwrap_or(&json!({})).to_string(),
                },
            })),
            "tool_result" => results.push(tool_result(block)),
            _ => {}
        }
    }
    if !content.is_empty() || !calls.is_empty() || !reasoning.is_empty() {
        let mut m = json!({"role": role});
        m["content"] = match content.is_empty() {
            true => "".into(),
            false => Value::Array(content),
        };
        if !calls.is_empty() {
            m["tool_calls"] = Value::Array(calls);
        }
        if !reasoning.is_empty() {
            m["reasoning_content"] = reasoning.into();
        }
        messages.push(m);
    }
    messages.extend(results);
}

/// An Anthropic image source as a chat's image part: `None` for a source of another kind.
fn image_part(source: &Value) -> Option<Value> {
    let url = match source["type"].as_str() {
        Some("base64") => format!(
            "data:{};base64,{}",
            source["media_type"].as_str().unwrap_or("image/jpeg"),
            source["data"].as_str().unwrap_or_default()
        ),
        Some("url") => source["url"].as_str().unwrap_or_default().to_string(),
        _ => return None,
    };
    Some(json!({"type": "image_url", "image_url": {"url": url}}))
}

/// A `tool_result` block as a tool message: its text whole when it has no image.
fn tool_result(block: &Value) -> Value {
    let id = block["tool_use_id"].as_str().unwrap_or_default();
    let content = match block.get("content") {
        Some(Value::String(s)) => Value::String(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            let mut all = Vec::new();
            let mut images = false;
            for part in parts {
                match part["type"].as_str() {
                    Some("text") => {
                        let t = part["text"].as_str().unwrap_or_default();
                        text.push_str(t);
                        all.push(json!({"type": "text", "text": t}));
                    }
                    Some("image") => {
                        images = true;
                        all.extend(image_part(&part["source"]));
                    }
                    _ => {}
                }
            }
            match images {
                true => Value::Array(all),
                false => Value::String(text),
            }
        }
        _ => "".into(),
    };
    json!({"role": "tool", "tool_call_id": id, "content": content})
}

/// Claude Code's system prompt begins with a billing header whose `cch=` stamp changes with
/// every request; llama-server writes it as `fffff` so that its cache gets past it.
fn billing_normalized(text: &str) -> String {
    const HEADER: &str = "x-anthropic-billing-header:";
    let mut out = text.to_string();
    if !text.starts_with(HEADER) {
        return out;
    }
    if let Some(at) = text[HEADER.len()..].find("cch=") {
        let from = HEADER.len() + at + 4;
        if text.as_bytes().get(from + 5) == Some(&b';') && text.is_char_boundary(from + 5) {
            out.replace_range(from..from + 5, "fffff");
        }
    }
    out
}

/// A `/v1/responses` body as llama-server's chat: the body less its Responses fields, with
/// `instructions` and `input` as messages.
pub fn responses(body: &Value) -> Result<Value, String> {
    let mut chat = body
        .as_object()
        .cloned()
        .ok_or("the request is not an object")?;
    let input = chat.remove("input").ok_or("'input' is required")?;
    if body["previous_response_id"]
        .as_str()
        .is_some_and(|s| !s.is_empty())
    {
        return Err("llama.cpp does not support 'previous_response_id'".into());
    }
    let mut messages: Vec<Value> = Vec::new();
    if let Some(instructions) = chat.remove("instructions") {
        let text = instructions.as_str().unwrap_or_default().to_string();
        messages.push(json!({"role": "system", "content": text}));
    }
    match input {
        Value::String(_) => messages.push(json!({"role": "user", "content": input})),
        Value::Array(items) => {
            for item in items {
                responses_item(item, &mut messages)?;
            }
        }
        _ => return Err("'input' must be a string or array of objects".into()),
    }
    chat.insert("messages".into(), Value::Array(messages));
    if let Some(tools) = chat.remove("tools") {
        let tools = tools
            .as_array()
            .ok_or("'tools' must be an array of objects")?;
        let functions: Vec<Value> = tools
            .iter()
            .filter(|t| t["type"] == "function")
            .filter_map(|t| t.as_object().cloned())
            .map(|mut f| {
                f.remove("type");
                f.entry("strict").or_insert(true.into());
                json!({"type": "function", "function": f})
            })
            .collect();
        if !functions.is_empty() {
            chat.insert("tools".into(), Value::Array(functions));
        }
    }
    if let Some(max) = chat.remove("max_output_tokens") {
        chat.insert("max_tokens".into(), max);
    }
    if let Some(reasoning) = chat.remove("reasoning") {
        if let Some(effort) = reasoning.get("effort") {
            chat.insert("reasoning_effort".into(), effort.clone());
        }
    }
    Ok(Value::Object(chat))
}

/// One item of a Responses `input` as the chat's messages; an assistant's output after an
/// assistant message is merged into it.
fn responses_item(mut item: Value, messages: &mut Vec<Value>) -> Result<(), String> {
    let merge = messages.last().is_some_and(|m| m["role"] == "assistant");
    if let Some(text) = item.get("content").and_then(Value::as_str) {
        item["content"] = json!([{"text": text, "type": "input_text"}]);
    }
    let kind = item["type"].as_str().unwrap_or_default().to_string();
    let role = item["role"].as_str().unwrap_or_default().to_string();
    let has = |key: &str| item.get(key).is_some_and(Value::is_string);
    if item["content"].is_array() && matches!(role.as_str(), "user" | "system" | "developer") {
        let parts = item["content"].as_array().into_iter().flatten();
        let content = parts.map(input_part).collect::<Result<Vec<_>, _>>()?;
        let m = item.as_object_mut().ok_or("an item is not an object")?;
        m.remove("type");
        m.remove("status");
        m.insert("content".into(), Value::Array(content));
        messages.push(item);
    } else if role == "assistant" && kind == "message" {
        let parts = item["content"].as_array().into_iter().flatten();
        let content = parts.map(output_part).collect::<Result<Vec<_>, _>>()?;
        match (merge, messages.last_mut()) {
            (true, Some(prev)) => {
                if !prev["content"].is_array() {
                    prev["content"] = json!([]);
                }
                if let Some(prev) = prev["content"].as_array_mut() {
                    prev.extend(content);
                }
            }
            _ => {
                let m = item.as_object_mut().ok_or("an item is not an object")?;
                m.remove("type");
                m.remove("status");
                m.insert("content".into(), Value::Array(content));
                messages.push(item);
            }
        }
    } else if kind == "function_call" && has("arguments") && has("call_id") && has("name") {
        let call = json!({
            "function": {"arguments": item["arguments"], "name": item["name"]},
            "id": item["call_id"],
            "type": "function",
        });
        match (merge, messages.last_mut()) {
            (true, Some(prev)) => match prev["tool_calls"].as_array_mut() {
                Some(calls) => calls.push(call),
                None => prev["tool_calls"] = json!([call]),
            },
            _ => messages.push(json!({"role": "assistant", "tool_calls": [call]})),
        }
    } else if kind == "function_call_output" && has("call_id") {
        let content = match &item["output"] {
            Value::String(s) => Value::String(s.clone()),
            Value::Array(parts) => Value::Array(
                parts
                    .iter()
                    .map(tool_output_part)
                    .collect::<Result<_, _>>()?,
            ),
            _ => return Err("Cannot determine type of 'item'".into()),
        };
        let id = item["call_id"].clone();
        messages.push(json!({"content": content, "role": "tool", "tool_call_id": id}));
    } else if kind == "reasoning" && item["summary"].is_array() {
        let text = item["content"][0]["text"]
            .as_str()
            .ok_or("item['content']['text'] is not a string")?
            .to_string();
        match (merge, messages.last_mut()) {
            (true, Some(prev)) => prev["reasoning_content"] = text.into(),
            _ => messages.push(json!({
                "role": "assistant", "content": [], "reasoning_content": text,
            })),
        }
    } else {
        return Err("Cannot determine type of 'item'".into());
    }
    Ok(())
}

/// A user, system or developer message's part.
fn input_part(part: &Value) -> Result<Value, String> {
    match part["type"].as_str().unwrap_or_default() {
        "input_text" => {
            let text = part.get("text").ok_or("'Input text' requires 'text'")?;
            Ok(json!({"text": text, "type": "text"}))
        }
        "input_image" => {
            let url = part.get("image_url").ok_or("'image_url' is required")?;
            Ok(json!({"image_url": {"url": url}, "type": "image_url"}))
        }
        other => Err(format!("an input part of type '{other}'")),
    }
}

/// An assistant message's part.
fn output_part(part: &Value) -> Result<Value, String> {
    match part["type"].as_str().unwrap_or_default() {
        "output_text" | "input_text" => {
            let text = part["text"]
                .as_str()
                .ok_or("'Output text' requires 'text'")?;
            Ok(json!({"text": text, "type": "text"}))
        }
        "refusal" => {
            let refusal = part["refusal"]
                .as_str()
                .ok_or("'Refusal' requires 'refusal'")?;
            Ok(json!({"refusal": refusal, "type": "refusal"}))
        }
        other => Err(format!("an output part of type '{other}'")),
    }
}

/// A part of a tool call's output.
fn tool_output_part(part: &Value) -> Result<Value, String> {
    let mut part = part.clone();
    match part["type"].as_str() {
        Some("input_text") => part["type"] = "text".into(),
        Some("input_image") => {
            let url = part
                .get("image_url")
                .cloned()
                .ok_or("'image_url' is required")?;
            part["type"] = "image_url".into();
            part["image_url"] = json!({"url": url});
        }
        _ => return Err("Output of tool call should be 'Input text' or 'Input image'".into()),
    }
    Ok(part)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_anthropic_conversation_is_the_chat_llama_server_makes_of_it() {
        let body = json!({
            "model": "m", "max_tokens": 64, "stream": true,
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=a5145;"},
                {"type": "text", "text": "You are a coder.", "cache_control": {"type": "ephemeral"}},
            ],
            "tools": [{"name": "Read", "description": "reads", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any"},
            "messages": [
                {"role": "user", "content": "read a.c"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hmm"},
                    {"type": "text", "text": "reading"},
                    {"type": "tool_use", "id": "t1", "name": "Read", "input": {"path": "a.c", "n": 1}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "int x;"}]},
                    {"type": "text", "text": "go on"},
                ]},
                {"role": "assistant"},
            ],
        });
        let want = json!({
            "messages": [
                {"role": "system", "content": "x-anthropic-billing-header: cc_version=2.1; cch=fffff;You are a coder."},
                {"role": "user", "content": "read a.c"},
                {"role": "assistant", "content": [{"type": "text", "text": "reading"}],
                 "reasoning_content": "hmm",
                 "tool_calls": [{"id": "t1", "type": "function",
                                 "function": {"name": "Read", "arguments": "{\"n\":1,\"path\":\"a.c\"}"}}]},
                {"role": "user", "content": [{"type": "text", "text": "go on"}]},
                {"role": "tool", "tool_call_id": "t1", "content": "int x;"},
            ],
            "tools": [{"type": "function", "function": {"name": "Read", "description": "reads",
                                                        "parameters": {"type": "object"}}}],
            "tool_choice": "required",
            "stream": true,
        });
        assert_eq!(anthropic(&body), Ok(want));
        assert!(anthropic(&json!({"max_tokens": 1}))
            .unwrap_err()
            .contains("messages"));
    }

    #[test]
    fn a_responses_conversation_is_the_chat_llama_server_makes_of_it() {
        let body = json!({
            "model": "m", "stream": true, "instructions": "be brief", "max_output_tokens": 9,
            "reasoning": {"effort": "low"},
            "tools": [
                {"type": "function", "name": "shell", "parameters": {"type": "object"}},
                {"type": "web_search"},
            ],
            "input": [
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "ls"}]},
                {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "run it"}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
                {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "a.c"},
                {"role": "user", "content": "and?"},
            ],
        });
        let want = json!({
            "model": "m", "stream": true, "max_tokens": 9, "reasoning_effort": "low",
            "tools": [{"type": "function", "function": {"name": "shell", "parameters": {"type": "object"}, "strict": true}}],
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"text": "ls", "type": "text"}]},
                {"role": "assistant", "content": [{"text": "ok", "type": "text"}], "reasoning_content": "run it",
                 "tool_calls": [{"function": {"arguments": "{}", "name": "shell"}, "id": "c1", "type": "function"}]},
                {"role": "tool", "tool_call_id": "c1", "content": "a.c"},
                {"role": "user", "content": [{"text": "and?", "type": "text"}]},
            ],
        });
        assert_eq!(responses(&body), Ok(want));
        let plain = responses(&json!({"input": "hi"})).unwrap();
        assert_eq!(
            plain,
            json!({"messages": [{"role": "user", "content": "hi"}]})
        );
        let bad = json!({"input": [{"type": "file_search_call"}]});
        assert!(responses(&bad).unwrap_err().contains("Cannot determine"));
        let chained = json!({"input": "hi", "previous_response_id": "r1"});
        assert!(responses(&chained)
            .unwrap_err()
            .contains("previous_response_id"));
    }
}
