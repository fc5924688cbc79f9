"""llama.cpp's flags that kimi-k3-cli and kimi-k3-server take without doing what llama.cpp does:
each is either ignored with one `note:` line saying why (what it asks for happens anyway, or
changes nothing that a run shows), or refused with one `error:` line saying what to use instead.

The one place these facts live: the parsers register every entry (runner/flags.py), --help's
epilog and the flag lists of docs/run.md and docs/server.md are written from it. A flag with the
same meaning in both runtimes is not here: the tool's parser defines it with its own help.
Spellings follow the flag tables of llama-cli's, llama-completion's and llama-server's READMEs.
"""
from __future__ import annotations

from dataclasses import dataclass

CLI, SERVER = "kimi-k3-cli", "kimi-k3-server"
BOTH = (CLI, SERVER)
NOTE, REFUSED = "note", "refused"


@dataclass(frozen=True)
class LlamaFlag:
    spellings: tuple[str, ...]
    kind: str  # NOTE or REFUSED
    why: str  # the note's reason, or the refusal's reason and what to use instead
    tools: tuple[str, ...] = BOTH
    nargs: int | str | None = None  # argparse's: None one value, 0 none, "?" an optional one, 2 two
    noop_values: tuple[str, ...] = ()  # a refused flag's values that ask for what happens anyway
    noop_why: str = ""  # the note for those values


def _n(spellings: str, why: str, nargs: int | str | None = None, tools: tuple[str, ...] = BOTH) -> LlamaFlag:
    return LlamaFlag(tuple(spellings.split()), NOTE, why, tools, nargs)


def _x(spellings: str, why: str, nargs: int | str | None = None, tools: tuple[str, ...] = BOTH,
       noop: tuple[str, ...] = (), noop_why: str = "") -> LlamaFlag:
    return LlamaFlag(tuple(spellings.split()), REFUSED, why, tools, nargs, noop, noop_why)


_CPU = "the runtime is CPU-only: every weight and cache is in host memory"
_GPU = "no GPU backend yet: the runtime is CPU-only"
_GET = "nothing is downloaded here: give the GGUF with -m FILE"
SPEC = _SPEC = "no speculative decoding here: the one model (-m) decodes every token"
_OS = "threads are placed and scheduled by the operating system here (use taskset, numactl or nice)"
_LOG = "the log is fixed: stderr, as kimi-k3-cli writes it"
_NOPE = "K3 has no RoPE (its MLA is NoPE), so there is nothing to scale"
_SAMPLERS = "not implemented: the samplers are --temp, --top-k, --top-p, --min-p and the repetition penalties"
_OFF = "that value turns the sampler off, and it is not implemented here anyway"
_TUNES = "it tunes a sampler that is not implemented here"
_EMBED = "no embeddings or reranking endpoint: kimi-k3-server generates text"
_ONE_MODEL = "one model per server: give it with -m FILE"
_PROXY = "put a reverse proxy in front of kimi-k3-server for it"
_PROMPT_FILE = "no prompt cache file here (kimi-k3-server keeps slot files with --slot-save-path)"
_FRAMES = "use -cnv: the chat template frames each turn"

COMMON = (
    _x("-cl --cache-list", "nothing is downloaded here, so there is no model cache to list", 0),
    _x("--completion-bash", "no bash completion script is shipped", 0),
    _n("-tb --threads-batch", "one thread count (-t) serves the prompt and the generation"),
    *(_n(s, _OS) for s in ("-C --cpu-mask", "-Cr --cpu-range", "--cpu-strict", "--prio", "--poll",
                           "-Cb --cpu-mask-batch", "-Crb --cpu-range-batch", "--cpu-strict-batch",
                           "--prio-batch", "--poll-batch")),
    _n("--no-context-shift", "there is no context shift here: a full context ends the reply", 0),
    _x("--context-shift", "no context shift here: a full context ends the reply (raise -c)", 0),
    _n("--keep", "there is no context shift here (a full context ends the reply), so nothing is kept"),
    _n("--swa-full", "K3 has no sliding-window layers", 0),
    _n("-fa --flash-attn", "the path decides: flash attention on the fast path, off with --exact-experts", "?"),
    _n("--perf --no-perf", "the timings are always printed (kimi_k3_perf lines)", 0),
    *(_n(s, _NOPE) for s in ("--rope-scaling", "--rope-scale", "--rope-freq-base", "--rope-freq-scale",
                             "--yarn-orig-ctx", "--yarn-ext-factor", "--yarn-attn-factor", "--yarn-beta-slow",
                             "--yarn-beta-fast")),
    _n("-kvo --kv-offload -nkvo --no-kv-offload", _CPU, 0),
    _n("--no-host", _CPU, 0),
    _n("--op-offload --no-op-offload", _CPU, 0),
    _n("-ctv --cache-type-v", "MLA caches one latent row per token and no V: -ctk sets its type"),
    _n("-dt --defrag-thold", "deprecated in llama.cpp; the caches here never need defragmenting"),
    _x("-lm --load-mode", "the GGUF is always memory-mapped here; --mem-budget bounds what stays resident",
       noop=("auto", "mmap"), noop_why="the GGUF is memory-mapped, as asked"),
    _n("-lzm --lazy-mode", "a tensor is read on demand only under --mem-budget"),
    _n("--numa", "threads are not placed per NUMA node here (numactl places the whole process)"),
    _x("-dev --device", _GPU, noop=("none",), noop_why=_CPU),
    _x("--list-devices", f"{_GPU}: the CPU is the one device", 0),
    _x("-ot --override-tensor", f"{_GPU}; --mem-budget streams what does not fit in memory"),
    _n("-cmoe --cpu-moe", _CPU, 0),
    _n("-ncmoe --n-cpu-moe", _CPU),
    _n("-ncffn --n-cpu-ffn", _CPU),
    _x("-ngl --gpu-layers --n-gpu-layers", f"{_GPU} (drop it, or give -ngl 0)", noop=("0", "auto"), noop_why=_CPU),
    _x("-sm --split-mode", f"{_GPU}; --rpc and -ts spread the layers over hosts"),
    _x("-mg --main-gpu", _GPU),
    _n("-fit --fit", "no option is adjusted to the memory: -c is as given, and --mem-budget bounds the weights", "?"),
    _n("-fitt --fit-target", "no option is adjusted to the memory here (--mem-budget bounds the weights)"),
    _n("-fitc --fit-ctx", "no option is adjusted to the memory here: -c is as given"),
    _x("--check-tensors", "no tensor data check at load: convert-kimi-k3 --verify checks a GGUF against its checkpoint", 0),
    _x("--lora", "LoRA adapters are not supported: merge the adapter into the checkpoint, then convert it"),
    _x("--lora-scaled", "LoRA adapters are not supported: merge the adapter into the checkpoint, then convert it"),
    _x("--control-vector --control-vector-scaled", "control vectors are not supported"),
    _x("--control-vector-layer-range", "control vectors are not supported", 2),
    _x("-mu --model-url", _GET),
    _x("-dr --docker-repo", _GET),
    _x("-hf -hfr --hf-repo", _GET),
    _x("-hff --hf-file", _GET),
    _x("-hft --hf-token", _GET),
    _n("--log-disable", _LOG, 0),
    _x("--log-file", "the log is stderr: redirect it (2> FILE)"),
    _n("--log-jsonl --no-log-jsonl", _LOG, 0),
    _n("--log-colors", _LOG, "?"),
    _n("-v --verbose --log-verbose", _LOG, 0),
    _n("--offline", "nothing is ever downloaded here", 0),
    _n("-lv --verbosity --log-verbosity", _LOG),
    _n("--log-prefix --no-log-prefix --log-timestamps --no-log-timestamps", _LOG, 0),
    _x("--spec-draft-type-k -ctkd --cache-type-k-draft --spec-draft-type-v -ctvd --cache-type-v-draft", _SPEC),
    _x("--samplers --sampler-seq --sampling-seq", "the samplers' order is fixed: the penalties, top-k, top-p, "
       "min-p, then the temperature (llama.cpp's default order of those)"),
    _x("--top-nsigma --top-n-sigma", _SAMPLERS, noop=("-1",), noop_why=_OFF),
    _x("--xtc-probability", _SAMPLERS, noop=("0",), noop_why=_OFF),
    _n("--xtc-threshold", _TUNES),
    _x("--typical --typical-p", _SAMPLERS, noop=("1",), noop_why=_OFF),
    _x("--dry-multiplier", _SAMPLERS, noop=("0",), noop_why=_OFF),
    _n("--dry-base --dry-allowed-length --dry-penalty-last-n --dry-sequence-breaker", _TUNES),
    _x("--adaptive-target", _SAMPLERS, noop=("-1",), noop_why=_OFF),
    _n("--adaptive-decay", _TUNES),
    _x("--dynatemp-range", _SAMPLERS, noop=("0",), noop_why=_OFF),
    _n("--dynatemp-exp", _TUNES),
    _x("--mirostat", _SAMPLERS, noop=("0",), noop_why=_OFF),
    _n("--mirostat-lr --mirostat-ent", _TUNES),
    _x("-l --logit-bias", "no logit bias here (--ignore-eos bans the end-of-generation token)"),
    _n("-bs --backend-sampling", "sampling always runs on the host, after the graph", 0),
    _n("--warmup --no-warmup", "the warm-up token is always evaluated while loading (it counts in the load time)", 0),
    _n("--mmproj-offload --no-mmproj-offload", _CPU, 0),
    _n("--mmproj-auto --no-mmproj --no-mmproj-auto", "an mmproj is used only when --mmproj names it", 0),
    _x("-mmu --mmproj-url", "nothing is downloaded here: give the mmproj with --mmproj FILE"),
    _x("-mmdev --mmproj-device", _GPU, noop=("none",), noop_why=_CPU),
    _n("--image-min-tokens --image-max-tokens", "an image's tokens follow the mmproj's own preprocessing"),
    _x("--video-fps --video-timestamp-interval --video-ffmpeg-dir",
       "a clip is given as its frame files, --video F0,F1,... (no video decoding)"),
    _n("--jinja", "chat templates always run as Jinja here", 0),
    _x("--skip-chat-parsing", "replies are always parsed into reasoning, content and tool calls: --reasoning-format "
       "none (a request's reasoning_format none) keeps the thinking in the text", 0),
    _n("--no-skip-chat-parsing", "replies are always parsed (docs/agents.md)", 0),
    _n("--reasoning-preserve", "the chat template renders every past turn's reasoning_content as it is given", 0),
    _x("--no-reasoning-preserve", "the chat template renders the reasoning_content the history gives: leave it out "
       "of the turns it should not see", 0),
    _x("--no-jinja", "chat templates always run as Jinja here; there is no other template engine", 0),
    _x("--log-prompts-dir", "prompts are not logged to files"),
    _x("--gpt-oss-20b-default --gpt-oss-120b-default --vision-gemma-4b-default --vision-gemma-12b-default", _GET, 0),
)

SPECULATIVE = tuple(_x(s, _SPEC, 0 if s.endswith(("default", "sampling")) else None) for s in (
    "--spec-draft-hf -hfd -hfrd --hf-repo-draft", "--spec-draft-threads -td --threads-draft",
    "--spec-draft-threads-batch -tbd --threads-batch-draft", "--spec-draft-cpu-mask -Cd --cpu-mask-draft",
    "--spec-draft-cpu-range -Crd --cpu-range-draft", "--spec-draft-cpu-strict --cpu-strict-draft",
    "--spec-draft-prio --prio-draft", "--spec-draft-poll --poll-draft",
    "--spec-draft-cpu-mask-batch -Cbd --cpu-mask-batch-draft", "--spec-draft-cpu-strict-batch --cpu-strict-batch-draft",
    "--spec-draft-prio-batch --prio-batch-draft", "--spec-draft-poll-batch --poll-batch-draft",
    "--spec-draft-override-tensor -otd --override-tensor-draft",
    "--spec-draft-n-cpu-moe --spec-draft-ncmoe -ncmoed --n-cpu-moe-draft", "--spec-draft-n-max", "--spec-draft-n-min",
    "--spec-synth-len", "--spec-synth-rates", "--spec-draft-p-split --draft-p-split",
    "--spec-draft-p-min --draft-p-min", "--spec-draft-device -devd --device-draft",
    "--spec-draft-ngl -ngld --gpu-layers-draft --n-gpu-layers-draft", "--spec-draft-model -md --model-draft",
    "--spec-type", "--spec-ngram-mod-n-min", "--spec-ngram-mod-n-max", "--spec-ngram-mod-n-match",
    "--spec-ngram-simple-size-n", "--spec-ngram-simple-size-m", "--spec-ngram-simple-min-hits",
    "--spec-ngram-map-k-size-n", "--spec-ngram-map-k-size-m", "--spec-ngram-map-k-min-hits",
    "--spec-ngram-map-k4v-size-n", "--spec-ngram-map-k4v-size-m", "--spec-ngram-map-k4v-min-hits",
    "--draft --draft-n --draft-max", "--draft-min --draft-n-min",
    "--spec-ngram-size-n", "--spec-ngram-size-m", "--spec-ngram-min-hits", "-lcs --lookup-cache-static",
    "-lcd --lookup-cache-dynamic", "--spec-draft-backend-sampling --no-spec-draft-backend-sampling",
    "--spec-default")) + (_x("--spec-draft-cpu-moe -cmoed --cpu-moe-draft", _SPEC, 0),)

# Flags only llama-cli or llama-completion has: kimi-k3-cli's.
RUNNER = tuple(LlamaFlag(f.spellings, f.kind, f.why, (CLI,), f.nargs, f.noop_values, f.noop_why) for f in (
    _x("--server-base", "kimi-k3-cli runs the model itself; an application talks to kimi-k3-server over HTTP"),
    _n("--verbose-prompt", "the prompt's tokens are not listed", 0),
    _n("-co --color", "the output is not coloured", "?"),
    _n("-ctxcp --ctx-checkpoints --swa-checkpoints", "one conversation keeps its whole cache; checkpoints are "
       "kimi-k3-server's"),
    _n("-cram --cache-ram", "kimi-k3-cli keeps no prompt cache besides the conversation's own"),
    _n("-np --parallel", "kimi-k3-cli decodes one sequence; slots are kimi-k3-server's -np"),
    _n("--show-timings --no-show-timings", "the timings are printed once, at the end (kimi_k3_perf lines)", 0),
    _n("-mli --multiline-input", "an input line ending in \\ goes on on the next line", 0),
    _n("--simple-io", "input is read line by line from standard input, with no console handling", 0),
    _x("-o --output --output-file", "the text goes to standard output: redirect it (> FILE)"),
    _x("--audio", "no audio encoder: K3's mmproj encodes images (--image) and clips (--video)"),
    _x("-bf --binary-file", "a prompt file is text here: -f FILE"),
    _n("-ptc --print-token-count", "the token counts are printed once, at the end (kimi_k3_perf lines)"),
    _x("--prompt-cache", _PROMPT_FILE),
    _x("--prompt-cache-all --prompt-cache-ro", _PROMPT_FILE, 0),
    _x("-if --interactive-first", "use -i: a conversation without -p waits for the first input", 0),
    _x("--in-prefix-bos", _FRAMES, 0),
    _x("--in-prefix --in-suffix", _FRAMES),
    _x("-gan --grp-attn-n -gaw --grp-attn-w", "no group attention (self-extend) here: the context is -c"),
))

# Flags only llama-server has, and the common ones that mean something else in a server.
SERVING = tuple(LlamaFlag(f.spellings, f.kind, f.why, (SERVER,), f.nargs, f.noop_values, f.noop_why) for f in (
    _n("-cram --cache-ram", "the prompt cache is bounded by --ctx-checkpoints per slot, not by a size"),
    _n("-cms --checkpoint-min-step", "a slot's checkpoint is taken at the end of each prompt"),
    _x("-kvu --kv-unified", "each slot has its own cache of -c / -np tokens here (no shared buffer)", 0),
    _n("-no-kvu --no-kv-unified", "each slot has its own cache of -c / -np tokens", 0),
    _x("--kv-unified-per-slot", "each slot has its own cache of -c / -np tokens here (no shared buffer)"),
    _n("--cache-idle-slots --no-cache-idle-slots", "an idle slot keeps its history until another prompt needs it",
       0),
    _x("--spm-infill", "no /infill endpoint here", 0),
    _x("--pooling", _EMBED),
    _n("-cb --cont-batching -nocb --no-cont-batching", "batching is always continuous here: the slots decode "
       "together, one graph per step", 0),
    _n("--mtmd-batch-max-tokens", "an image is encoded whole"),
    _n("--tags", "/v1/models lists the model without tags"),
    _x("--embd-normalize", _EMBED),
    _x("--embedding --embeddings --rerank --reranking", _EMBED, 0),
    _n("--reuse-port", "the port is bound once, by this process", 0),
    _x("--path", "the chat page is built in; no other static files are served"),
    _x("--cors-origins --cors-methods --cors-headers", f"no CORS headers are sent: {_PROXY}"),
    _x("--cors-credentials --no-cors-credentials", f"no CORS headers are sent: {_PROXY}", 0),
    _x("--api-prefix", f"the endpoints are at the root: {_PROXY}"),
    _x("--ui-config --webui-config --ui-config-file --webui-config-file", "the chat page has no settings file"),
    _x("--ui-mcp-proxy --webui-mcp-proxy", "no MCP proxy here", 0),
    _n("--no-ui-mcp-proxy --no-webui-mcp-proxy", "there is no MCP proxy here", 0),
    _x("--tools-runtime --mcp-servers-config --mcp-servers-json", "no server-side tools or MCP servers here"),
    _x("-ag --agent", "no server-side agent here", 0),
    _x("--tools", "the server runs no tools of its own: a client declares its tools in a request and runs them "
       "(docs/agents.md)"),
    _n("-no-ag --no-agent", "there is no server-side agent here", 0),
    _n("--ui --webui", "the chat page at / is always served", 0),
    _n("--no-ui --no-webui", "the chat page at / is always served; it is a static page, and the API behind it "
       "needs the key given with --api-key", 0),
    _x("--api-key-file", "give the key with --api-key KEY (one key)"),
    _x("--ssl-key-file --ssl-cert-file", f"no TLS here: {_PROXY}"),
    _n("--sse-ping-interval", "a stream sends no keep-alive pings"),
    _n("--threads-http", "requests are handled on uvicorn's event loop and its thread pool"),
    _n("--cache-prompt", "a request's cache_prompt is true unless it says false", 0),
    _x("--no-cache-prompt", "a request turns the prompt cache off with \"cache_prompt\": false", 0),
    _x("--cache-reuse", "no KV shifting here: a slot's cache serves a prompt when its whole history, or a "
       "checkpoint, is a prefix of it", noop=("0",),
       noop_why="0 is llama-server's default, off"),
    _n("--metrics", "/metrics is always served", 0),
    _n("--props", "GET /props is always served (POST /props is not)", 0),
    _n("--slots", "GET /slots is always served", 0),
    _x("--no-slots", "GET /slots is always served (behind --api-key when one is given)", 0),
    _x("--media-path", "images come in a request as data: URIs, never from this machine's files"),
    _x("--models-dir --models-preset --models-max", _ONE_MODEL),
    _x("--models-autoload", _ONE_MODEL, 0),
    _n("--no-models-autoload", _ONE_MODEL, 0),
    _x("--prefill-assistant", "a last assistant message is rendered as a finished turn, not continued", 0),
    _n("--no-prefill-assistant", "a last assistant message is rendered as a finished turn", 0),
    _n("-sps --slot-prompt-similarity", "a request goes to the free slot that holds the longest cached prefix of its "
       "prompt"),
    _x("--lora-init-without-apply", "LoRA adapters are not supported", 0),
    _n("--sleep-idle-seconds", "the model stays loaded while the server runs"),
    _x("--embd-gemma-default --fim-qwen-1.5b-default --fim-qwen-3b-default --fim-qwen-7b-default "
       "--fim-qwen-7b-spec --fim-qwen-14b-spec --fim-qwen-30b-default", _GET, 0),
    _n("-e --escape --no-escape", "the server reads no prompt from its command line", 0),
    _n("-r --reverse-prompt", "a request gives its own stop strings ('stop')"),
    _n("-sp --special", "a completion's text shows special tokens and a chat reply never does, as the protocol has it",
       0),
))

FLAGS: tuple[LlamaFlag, ...] = COMMON + SPECULATIVE + RUNNER + SERVING
