// The conversations, kept in this browser's localStorage, so that a reload or another visit finds
// them again. Nothing of them is kept by the server.
//
//   [{id, title, updated, messages: [{role, content, reasoning, note, state}]}]   newest first
//
// A message's `content` is what goes back to the server: a string, or for a user message with
// images, OpenAI's content parts. `reasoning`, `note` and `state` are only shown.
"use strict";

const STORE_KEY = "kimi-k3-conversations";
const CURRENT_KEY = "kimi-k3-current";

function loadConversations() {
  try {
    const list = JSON.parse(localStorage.getItem(STORE_KEY) || "[]");
    return Array.isArray(list) ? list.filter((c) => c && Array.isArray(c.messages)) : [];
  } catch (_) {
    return [];  // unreadable (edited by hand?): start afresh rather than not at all
  }
}

// Write the list; false when the browser's storage is full (images take much room).
function saveConversations(list, currentId) {
  try {
    localStorage.setItem(STORE_KEY, JSON.stringify(list));
    localStorage.setItem(CURRENT_KEY, currentId || "");
    return true;
  } catch (_) {
    return false;
  }
}

function savedCurrentId() {
  return localStorage.getItem(CURRENT_KEY) || "";
}

function newConversation() {
  const id = Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
  return { id, title: "", updated: Date.now(), messages: [] };
}

// The text of a message's content (its text parts joined), and its images' data: URIs.
function textOf(content) {
  if (typeof content === "string") return content;
  return (content || []).filter((p) => p.type === "text").map((p) => p.text).join("\n");
}

function imagesOf(content) {
  if (!Array.isArray(content)) return [];
  return content.filter((p) => p.type === "image_url").map((p) => p.image_url.url);
}

// A conversation's name in the list: the start of its first user message.
function titleOf(conversation) {
  const first = conversation.messages.find((m) => m.role === "user");
  if (!first) return "New chat";
  const text = textOf(first.content).trim().replace(/\s+/g, " ");
  if (!text) return imagesOf(first.content).length ? "(image)" : "New chat";
  return text.length > 48 ? text.slice(0, 47) + "…" : text;
}
