#!/usr/bin/env python3
"""Reference renderer for chat templates: Python's jinja2 configured exactly as Hugging Face
transformers configures it for apply_chat_template (ImmutableSandboxedEnvironment with
trim_blocks=True, lstrip_blocks=True, the loopcontrols extension, a {% generation %} tag that renders
its body, a tojson filter that is json.dumps(ensure_ascii=False, ...), raise_exception and
strftime_now). kiln's C++ interpreter is tested for byte-identical output against it.

Requests are OpenAI-style chat requests, prepared the way kiln (and SGLang/vLLM) prepare them:
tool-call `arguments` given as JSON strings are parsed (kept as strings when not valid JSON),
`tools` defaults to None, `add_generation_prompt` to True, and chat_template_kwargs become template
variables.

Usage:
  template_oracle.py --template T.jinja [--bos-token X] [--eos-token Y] < request.json
      prints the rendered prompt (no trailing newline); exit 1 with the error on stderr.
  template_oracle.py --manifest templates.json --conversations conversations.json
      prints {"<template file>": [{"name": ..., "ok": true, "prompt": ...} | {"ok": false,
      "error": ...}, ...]} for every template of the manifest and every conversation.
  template_oracle.py --snippets snippets.json
      renders each {"name", "template", "vars"} of the file with vars as template variables; prints
      [{"name": ..., "ok": true, "output": ...} | {"name": ..., "ok": false, "error": ...}, ...].
"""
import argparse
import copy
import json
import os
import sys
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class GenerationTag(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: HF's AssistantTracker, rendering only."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


def make_environment():
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def prepare_messages(messages):
    messages = copy.deepcopy(messages)
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if not isinstance(calls, list):
            continue
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    pass
    return messages


def render(template, request, bos_token="", eos_token=""):
    variables = {
        "messages": prepare_messages(request["messages"]),
        "tools": request.get("tools"),
        "documents": None,
        "add_generation_prompt": True if request.get("add_generation_prompt") is None
        else request["add_generation_prompt"],
    }
    if bos_token:
        variables["bos_token"] = bos_token
    if eos_token:
        variables["eos_token"] = eos_token
    variables.update(request.get("chat_template_kwargs") or {})
    return template.render(**variables)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--template")
    ap.add_argument("--bos-token", default="")
    ap.add_argument("--eos-token", default="")
    ap.add_argument("--manifest")
    ap.add_argument("--conversations")
    ap.add_argument("--snippets")
    args = ap.parse_args()
    env = make_environment()

    if args.snippets:
        with open(args.snippets, encoding="utf-8") as f:
            snippets = json.load(f)
        rows = []
        for snippet in snippets:
            try:
                output = env.from_string(snippet["template"]).render(**snippet.get("vars", {}))
                rows.append({"name": snippet["name"], "ok": True, "output": output})
            except Exception as e:  # noqa: BLE001
                rows.append({"name": snippet["name"], "ok": False, "error": f"{type(e).__name__}: {e}"})
        json.dump(rows, sys.stdout, ensure_ascii=False)
        return 0

    if args.template:
        with open(args.template, encoding="utf-8") as f:
            template = env.from_string(f.read())
        request = json.load(sys.stdin)
        try:
            sys.stdout.write(render(template, request, args.bos_token, args.eos_token))
        except Exception as e:  # noqa: BLE001 - report any template failure
            print(f"{type(e).__name__}: {e}", file=sys.stderr)
            return 1
        return 0

    if not (args.manifest and args.conversations):
        ap.error("give --template, or --manifest and --conversations")
    with open(args.manifest, encoding="utf-8") as f:
        manifest = json.load(f)
    with open(args.conversations, encoding="utf-8") as f:
        conversations = json.load(f)
    base = os.path.dirname(os.path.abspath(args.manifest))
    results = {}
    for entry in manifest:
        with open(os.path.join(base, entry["file"]), encoding="utf-8") as f:
            template = env.from_string(f.read())
        rows = []
        for conv in conversations:
            try:
                prompt = render(template, conv["request"], entry.get("bos_token", ""), entry.get("eos_token", ""))
                rows.append({"name": conv["name"], "ok": True, "prompt": prompt})
            except Exception as e:  # noqa: BLE001
                rows.append({"name": conv["name"], "ok": False, "error": f"{type(e).__name__}: {e}"})
        results[entry["file"]] = rows
    json.dump(results, sys.stdout, ensure_ascii=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
