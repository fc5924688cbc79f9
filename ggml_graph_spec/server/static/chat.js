// The chat page of kimi-k3-server: conversations (store.js) whose replies stream from
// /v1/chat/completions (stream.js), the think channel apart from the answer, replies as markdown
// (markdown.js), and images when the server has a vision encoder (/props). No build step and
// nothing from elsewhere: index.html, chat.css, these scripts and the vendored markdown-it are all.
"use strict";

const $ = (id) => document.getElementById(id);
const SETTINGS = ["system", "thinking", "reasoning_budget", "temperature", "top_k", "top_p", "min_p",
                  "repeat_penalty", "max_tokens", "seed", "api_key"];
const NUMBERS = { temperature: parseFloat, top_k: parseInt, top_p: parseFloat, min_p: parseFloat,
                  repeat_penalty: parseFloat, max_tokens: parseInt, seed: parseInt };
const BUSY_HINT = "A reply is still coming: wait for it, or press Stop.";

let conversations = loadConversations();
let current = null;     // the conversation shown; in `conversations` once it has a message
let controller = null;  // the AbortController of the reply streaming now
let attachments = [];   // data: URIs of the images that go with the next message

// ---- settings and the request ---------------------------------------------------------------

function loadSettings() {
  for (const name of SETTINGS) {
    const field = $(name), key = "kimi-k3-" + name, checkbox = field.type === "checkbox";
    const saved = localStorage.getItem(key);
    if (saved !== null && checkbox) field.checked = saved === "true";
    else if (saved !== null) field.value = saved;
    field.addEventListener("change", () => localStorage.setItem(key, checkbox ? String(field.checked) : field.value));
  }
}

function headers() {
  const h = { "Content-Type": "application/json" };
  if ($("api_key").value) h["Authorization"] = "Bearer " + $("api_key").value;
  return h;
}

// The request for the next reply to `messages`. Only role and content go back: the think channel
// of earlier replies is shown, not sent (as OpenAI's clients do).
function requestBody(messages) {
  const system = $("system").value.trim() ? [{ role: "system", content: $("system").value }] : [];
  const body = { messages: system.concat(messages.map((m) => ({ role: m.role, content: m.content }))),
                 stream: true, stream_options: { include_usage: true } };
  for (const [name, parse] of Object.entries(NUMBERS)) {
    const value = parse($(name).value);
    if (!Number.isNaN(value)) body[name] = value;
  }
  if (body.max_tokens === -1) delete body.max_tokens;
  if (!$("thinking").checked) {
    body.chat_template_kwargs = { thinking: false };
  } else {
    const budget = parseInt($("reasoning_budget").value, 10);
    if (budget >= 0) body.reasoning_budget_tokens = budget;
  }
  return body;
}

function userContent(text, images) {
  if (!images.length) return text;
  const parts = images.map((url) => ({ type: "image_url", image_url: { url } }));
  return text ? parts.concat([{ type: "text", text }]) : parts;
}

// ---- messages on the page -------------------------------------------------------------------

function button(label, className, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = className;
  b.textContent = label;
  b.addEventListener("click", onClick);
  return b;
}

function image(url) {
  const img = document.createElement("img");
  img.className = "image";
  img.alt = "attached image";
  img.src = url;  // a data: URI the user picked (the page's policy allows data: images only)
  return img;
}

// An assistant bubble's parts: the think channel in a collapsible block (open while the model
// thinks, closed once the answer begins, there to open again), the answer as markdown.
function replyView(div) {
  const answer = document.createElement("div");
  answer.className = "answer";
  div.appendChild(answer);
  let thinking = null, shown = { reasoning: "", content: null };
  return function paint(reasoning, content, finished) {
    if (reasoning && !thinking) {
      thinking = document.createElement("details");
      thinking.className = "thinking";
      thinking.open = true;
      thinking.append(document.createElement("summary"), document.createElement("div"));
      thinking.lastChild.className = "reasoning";
      div.insertBefore(thinking, answer);
    }
    if (thinking) {
      if (reasoning !== shown.reasoning) thinking.lastChild.textContent = reasoning;  // text only, never HTML
      if (content && !thinking.dataset.answered) {
        thinking.dataset.answered = "true";
        thinking.open = false;
      }
      thinking.firstChild.textContent = content || finished ? "Thought process" : "Thinking…";
    }
    if (content !== shown.content) renderMarkdown(answer, content);
    shown = { reasoning, content };
  };
}

function note(div, text) {
  const span = document.createElement("span");
  span.className = "note";
  span.textContent = text;
  div.insertBefore(span, div.querySelector(".actions"));
}

function actions(message, index) {
  const bar = document.createElement("div");
  bar.className = "actions";
  bar.appendChild(copyButton(() => textOf(message.content), "copy"));
  if (message.role === "user") bar.appendChild(button("Edit", "edit", () => startEdit(index)));
  else bar.appendChild(button("Regenerate", "regenerate", regenerate));  // CSS shows it on the last reply only
  return bar;
}

function messageElement(message, index) {
  const div = document.createElement("div");
  div.className = "message " + message.role;
  div.dataset.index = index;
  if (message.state) div.dataset.state = message.state;
  if (message.role === "user") {
    for (const url of imagesOf(message.content)) div.appendChild(image(url));
    const text = document.createElement("div");
    text.className = "text";
    text.textContent = textOf(message.content);
    div.appendChild(text);
  } else {
    replyView(div)(message.reasoning || "", textOf(message.content), true);
  }
  div.appendChild(actions(message, index));
  if (message.note) note(div, message.note);
  return div;
}

function nearBottom() {
  const box = $("messages");
  return box.scrollHeight - box.scrollTop - box.clientHeight < 48;
}

function toBottom() {
  $("messages").scrollTop = $("messages").scrollHeight;
}

function renderConversation() {
  $("messages").textContent = "";
  current.messages.forEach((m, i) => $("messages").appendChild(messageElement(m, i)));
  toBottom();
}

function renderList() {
  const list = $("chat-list");
  list.textContent = "";
  for (const c of conversations) {
    const item = document.createElement("li");
    if (c === current) item.setAttribute("aria-current", "true");
    const open = button(c.title || "New chat", "open", () => switchTo(c));
    open.title = new Date(c.updated).toLocaleString();
    const remove = button("×", "delete", () => deleteConversation(c));
    remove.title = "Delete this conversation";
    remove.setAttribute("aria-label", "Delete " + open.textContent);
    item.append(open, remove);
    list.appendChild(item);
  }
}

function renderAttachments() {
  const box = $("attachments");
  box.textContent = "";
  attachments.forEach((url, i) => {
    const item = document.createElement("span");
    item.className = "attachment";
    item.append(image(url), button("×", "remove", () => { attachments.splice(i, 1); renderAttachments(); }));
    box.appendChild(item);
  });
}

// ---- conversations --------------------------------------------------------------------------

// Keep a changed conversation (newest first in the list); say so when the browser cannot.
function persist(conversation) {
  conversation.title = titleOf(conversation);
  conversation.updated = Date.now();
  const keep = conversation.messages.length && !conversation.deleted;  // a reply stopped by a delete stays gone
  if (keep && !conversations.includes(conversation)) conversations.unshift(conversation);
  conversations.sort((a, b) => b.updated - a.updated);
  save();
}

function save() {
  if (!saveConversations(conversations, current.id)) {
    $("status").textContent = "This browser's storage is full: the conversation is not kept. Delete old " +
                              "conversations (images take the most room).";
  }
  renderList();
}

function stopReply() {
  if (controller) controller.abort();  // the stopped reply is kept in its own conversation
}

function show(conversation) {
  current = conversation;
  renderConversation();
  save();
}

function switchTo(conversation) {
  if (conversation === current) return;
  stopReply();
  show(conversation);
}

function deleteConversation(conversation) {
  conversation.deleted = true;
  conversations = conversations.filter((c) => c !== conversation);
  if (conversation === current) {
    stopReply();
    show(newConversation());
  } else {
    save();
  }
}

// Enter (or an edit, a regenerate) while a reply streams: say why nothing happens.
function refuseWhileBusy() {
  if (!controller) return false;
  $("hint").textContent = BUSY_HINT;
  return true;
}

function startEdit(index) {
  if (refuseWhileBusy()) return;
  const message = current.messages[index];
  const div = $("messages").querySelector(`[data-index="${index}"]`);
  const area = document.createElement("textarea");
  area.className = "edit";
  area.value = textOf(message.content);
  const resend = () => {
    if (!area.value.trim() && !imagesOf(message.content).length) return;
    current.messages = current.messages.slice(0, index);  // what came after it was an answer to the old text
    current.messages.push({ role: "user", content: userContent(area.value, imagesOf(message.content)) });
    persist(current);
    renderConversation();
    generate(current);
  };
  area.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); resend(); }
  });
  const bar = document.createElement("div");
  bar.className = "actions editing";
  bar.append(button("Send", "resend", resend), button("Cancel", "cancel", renderConversation));
  div.querySelector(".text").replaceWith(area);
  div.querySelector(".actions").replaceWith(bar);
  area.focus();
}

function regenerate() {
  if (refuseWhileBusy()) return;
  const messages = current.messages;
  while (messages.length && messages[messages.length - 1].role !== "user") messages.pop();
  if (!messages.length) return;
  persist(current);
  renderConversation();
  generate(current);
}

// ---- a reply ----------------------------------------------------------------------------------

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
  $("status").textContent = on ? "generating..." : "";
  document.body.classList.toggle("busy", on);
  if (!on) $("hint").textContent = "";
}

// The next reply of a conversation whose last message is the user's. The bubble is painted at
// most once a frame: a long reply re-rendered as markdown on every token would make typing lag.
async function generate(conversation) {
  const div = document.createElement("div");
  div.className = "message assistant";
  div.dataset.state = "streaming";
  $("messages").appendChild(div);
  toBottom();
  const paint = replyView(div);
  const reply = { content: "", reasoning: "", timings: null, usage: null };
  let frame = 0;
  const draw = () => {
    frame = 0;
    const stick = nearBottom();
    paint(reply.reasoning, reply.content, false);
    if (stick) toBottom();
  };
  controller = new AbortController();
  busy(true);
  let message = null;
  try {
    await streamReply(requestBody(conversation.messages), headers(), reply,
                      () => { frame = frame || requestAnimationFrame(draw); }, controller.signal);
    message = { role: "assistant", content: reply.content, reasoning: reply.reasoning, state: "done",
                note: timingNote(reply) };
  } catch (err) {
    if (err.name !== "AbortError") return failed(div, err.message);
    message = { role: "assistant", content: reply.content, reasoning: reply.reasoning, state: "stopped",
                note: "stopped" };
  } finally {
    cancelAnimationFrame(frame);
    controller = null;
    busy(false);
  }
  paint(message.reasoning, message.content, true);
  conversation.messages.push(message);
  persist(conversation);
  div.dataset.index = conversation.messages.length - 1;
  div.appendChild(actions(message, conversation.messages.length - 1));
  if (message.note) note(div, message.note);
  div.dataset.state = message.state;
}

// A reply that failed is not kept: the bubble says why, and Retry asks again.
function failed(div, text) {
  div.className = "message error";
  div.dataset.state = "error";
  div.textContent = "";
  const span = document.createElement("div");
  span.className = "text";
  span.textContent = text;
  div.append(span, button("Retry", "regenerate", regenerate));
}

// ---- wiring ---------------------------------------------------------------------------------

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("input").value;
  if (!text.trim() && !attachments.length) return;
  if (refuseWhileBusy()) return;  // the text stays in the box for when the reply is done
  $("input").value = "";
  current.messages.push({ role: "user", content: userContent(text, attachments) });
  attachments = [];
  renderAttachments();
  persist(current);
  $("messages").appendChild(messageElement(current.messages.at(-1), current.messages.length - 1));
  generate(current);
});
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", stopReply);
$("new-chat").addEventListener("click", () => {
  stopReply();
  show(newConversation());
});

function readFile(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);  // data:image/png;base64,...: what the server's image_url parts take
  });
}

$("attach").addEventListener("click", () => $("file").click());
$("file").addEventListener("change", async () => {
  for (const file of Array.from($("file").files)) attachments.push(await readFile(file));
  $("file").value = "";
  renderAttachments();
});

// The attach button only when the server can see images (--mmproj: /props says so). /props
// answers 503 while the model loads, and 401 without the key the server wants.
async function loadProps() {
  let vision = false;
  try {
    const response = await fetch("/props", { headers: headers() });
    if (response.status === 503) {
      setTimeout(loadProps, 2000);
      return;
    }
    const props = response.ok ? await response.json() : {};
    vision = Boolean(props.modalities && props.modalities.vision);
  } catch (_) {
    // no server: no button
  }
  $("attach").hidden = !vision;
}

// Another tab of this page wrote the conversations: take its list, so that this tab's next write
// keeps them. The conversation shown here stays as this tab has it.
window.addEventListener("storage", (e) => {
  if (e.key !== STORE_KEY) return;
  conversations = loadConversations().map((c) => (c.id === current.id ? current : c));
  renderList();
});

// A reasoning budget means nothing without the think channel.
function thinkingChanged() {
  $("reasoning_budget").disabled = !$("thinking").checked;
}

loadSettings();
thinkingChanged();
$("thinking").addEventListener("change", thinkingChanged);
$("api_key").addEventListener("change", loadProps);
show(conversations.find((c) => c.id === savedCurrentId()) || newConversation());
loadProps();
fetch("/v1/models").then((r) => r.json()).then((m) => { $("model").textContent = m.data[0].id; }).catch(() => {});
