// The chat page of kimi-k3-server: one conversation, streamed from /v1/chat/completions.
// No build step and nothing from elsewhere: this file, chat.css and index.html are all of it.
"use strict";

const $ = (id) => document.getElementById(id);
const SETTINGS = ["system", "temperature", "top_k", "top_p", "min_p", "repeat_penalty", "max_tokens", "seed",
                  "api_key"];
const NUMBERS = { temperature: parseFloat, top_k: parseInt, top_p: parseFloat, min_p: parseFloat,
                  repeat_penalty: parseFloat, max_tokens: parseInt, seed: parseInt };
let history = [];      // {role, content} of the finished turns
let controller = null; // the AbortController of the reply streaming now

function loadSettings() {
  for (const name of SETTINGS) {
    const saved = localStorage.getItem("kimi-k3-" + name);
    if (saved !== null) $(name).value = saved;
    $(name).addEventListener("change", () => localStorage.setItem("kimi-k3-" + name, $(name).value));
  }
}

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = "message " + role;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  div.appendChild(body);
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

function note(div, text) {
  const span = document.createElement("span");
  span.className = "note";
  span.textContent = text;
  div.appendChild(span);
}

function headers() {
  const h = { "Content-Type": "application/json" };
  if ($("api_key").value) h["Authorization"] = "Bearer " + $("api_key").value;
  return h;
}

function requestBody() {
  const messages = [];
  if ($("system").value.trim()) messages.push({ role: "system", content: $("system").value });
  const body = { messages: messages.concat(history), stream: true, stream_options: { include_usage: true } };
  for (const [name, parse] of Object.entries(NUMBERS)) {
    const value = parse($(name).value);
    if (!Number.isNaN(value)) body[name] = value;
  }
  if (body.max_tokens === -1) delete body.max_tokens;
  return body;
}

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
  $("status").textContent = on ? "generating..." : "";
}

// Server-sent events from a fetch body: "data: {...}" lines, events split by a blank line.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

async function errorText(response) {
  try {
    const body = await response.json();
    return body.error ? body.error.message : response.statusText;
  } catch (_) {
    return response.status + " " + response.statusText;
  }
}

async function streamReply(div, text) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST", headers: headers(), body: JSON.stringify(requestBody()), signal: controller.signal });
  if (!response.ok) throw new Error(await errorText(response));
  let reply = "", timings = null, usage = null;
  for await (const event of events(response)) {
    if (event.error) throw new Error(event.error.message);
    if (event.usage) usage = event.usage;
    if (event.timings) timings = event.timings;
    for (const choice of event.choices || []) {
      if (choice.delta && choice.delta.content) {
        reply += choice.delta.content;
        text.textContent = reply;
        $("messages").scrollTop = $("messages").scrollHeight;
      }
    }
  }
  return { reply, timings, usage };
}

async function send(content) {
  history.push({ role: "user", content });
  bubble("user", content);
  const div = bubble("assistant", "");
  const text = div.querySelector(".text");
  div.dataset.state = "streaming";
  controller = new AbortController();
  busy(true);
  try {
    const { reply, timings, usage } = await streamReply(div, text);
    history.push({ role: "assistant", content: reply });
    div.dataset.state = "done";
    if (timings) {
      const cached = usage ? usage.prompt_tokens_details.cached_tokens : timings.cache_n;
      note(div, `${timings.predicted_n} tokens, ${timings.predicted_per_second.toFixed(2)} tokens/s; ` +
                `prompt ${timings.prompt_n} tokens (${cached} from the cache)`);
    }
  } catch (err) {
    if (err.name === "AbortError") {
      history.push({ role: "assistant", content: text.textContent });
      div.dataset.state = "stopped";
      note(div, "stopped");
    } else {
      history.pop();
      div.className = "message error";
      div.dataset.state = "error";
      text.textContent = err.message;
    }
  } finally {
    controller = null;
    busy(false);
  }
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const content = $("input").value;
  if (!content.trim() || controller) return;
  $("input").value = "";
  send(content);
});
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("new-chat").addEventListener("click", () => {
  if (controller) controller.abort();
  history = [];
  $("messages").textContent = "";
});

loadSettings();
fetch("/v1/models").then((r) => r.json()).then((m) => { $("model").textContent = m.data[0].id; }).catch(() => {});
