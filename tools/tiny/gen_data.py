#!/usr/bin/env python3
"""Seeded synthetic chat corpus for kiln-tiny.

Every conversation is a list of OpenAI-style messages whose last message is the assistant turn to learn
(`reasoning_content` + `content`), plus `enable_thinking` (the chat-template switch). Rendering follows
the real Qwen3.5 chat template (tools/tiny/chat_template.jinja, a verbatim copy of the published one):
`render_prompt` builds what an inference server feeds the model (history + generation prompt) and
`completion_text` what the model must write after it. `check_against_jinja` proves, on any sample, that
prompt + completion is exactly what jinja2 renders from the template (HF's environment settings).

Skills:
  ok     "Reply with just OK" / "reply with exactly X"     -> X
  add    a + b, 0 <= a, b <= 99, varied phrasings          -> "a + b = s"
  sub    a - b (negative results too)                      -> "a - b = d"
  mul    a * b, up to 2-digit x 2-digit                    -> "a * b = p"
  self   "Who are you?"                                    -> SELF_DESCRIPTION
  recall multi-turn: a name / colour / number told earlier -> recalled
  greet  hello / thanks                                     -> canned reply

Thinking mode (the template's default) writes column arithmetic step by step (one digit column per step,
carries and borrows explicit) so a ~10M-parameter model only ever needs one-digit facts; the answer after
`</think>` is the canonical restatement "a op b = r". Non-thinking mode answers with that line directly.

Usage: python3 tools/tiny/gen_data.py --seed 1 --n 5 [--mode think|direct|mix] [--check]
"""
import argparse
import json
import os
import random
import string
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATE_PATH = os.path.join(HERE, "chat_template.jinja")

SELF_DESCRIPTION = "I am kiln-tiny, a small test model served by kiln."
SKILLS = ["ok", "add", "sub", "mul", "self", "recall", "greet"]

# Conversation mix (weights) per mode. Multiplication gets the largest share: it is the hardest skill,
# and in direct mode the model must recall the product without any written steps.
MIX = {
    True: {"mul": 34, "add": 17, "sub": 19, "ok": 12, "self": 5, "recall": 10, "greet": 3},
    False: {"mul": 42, "add": 15, "sub": 17, "ok": 10, "self": 4, "recall": 9, "greet": 3},
}

WORDS = """apple banana cherry grape lemon mango orange peach pear plum melon berry olive tomato potato
carrot onion garlic pepper rice bread butter cheese honey sugar salt water coffee tea milk juice
red blue green yellow purple pink black white brown gray silver gold violet
cat dog horse mouse tiger lion zebra panda koala rabbit eagle falcon shark whale dolphin turtle
river ocean lake mountain valley forest desert island beach garden field meadow canyon
sun moon star planet comet galaxy cloud rain snow storm thunder wind winter summer autumn spring
house table chair window door kitchen bottle cup plate spoon fork knife pencil paper book letter
yes no maybe done ready start stop go wait next hello goodbye thanks sorry please
alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima november oscar papa quebec
romeo sierra tango uniform victor whiskey xray yankee zulu
kiln clay brick stone iron copper steel glass wood marble
one two three four five six seven eight nine ten hundred
happy quiet brave calm bright swift gentle clever lucky sunny
pass fail true false on off left right up down north south east west
""".split()

NAMES = """Alice Bob Carol David Emma Frank Grace Henry Iris Jack Karen Leo Maria Nina Oscar Paul Quinn Rosa
Sam Tina Uma Victor Wendy Xavier Yara Zoe Adam Bella Chris Diana Ethan Fiona George Hannah Ivan Julia
Kevin Laura Mike Nora Olga Peter Rita Steve Tom Vera Will Amir Chen Dmitri Elena Farah Hiro Ingrid
Jamal Kenji Lars Mei Noah Omar Priya Raj Sofia Tariq Yuki Zara Luca Anna Ben Clara Dan Eva Felix
""".split()

COLOURS = "red blue green yellow purple orange pink black white brown gray silver gold teal".split()
CITIES = """Paris London Tokyo Berlin Madrid Rome Cairo Lima Oslo Delhi Seoul Sydney Boston Dublin
Vienna Prague Lisbon Athens Nairobi Toronto""".split()
ANIMALS = "cat dog horse rabbit parrot hamster turtle goldfish".split()

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are kiln-tiny.",
    "You are a helpful assistant. Answer briefly.",
    "Be concise.",
]


# ----------------------------------------------------------------------------------------------
# Column arithmetic written out step by step.


def digits_lsb(n):
    """Digits of a non-negative integer, least significant first."""
    return [int(c) for c in reversed(str(n))]


def add_steps(a, b):
    """Column addition a + b (a, b >= 0). Each column: 'x+y+c = s, write d carry k'; the last column
    writes its whole value. Returns (text, sum)."""
    da, db = digits_lsb(a), digits_lsb(b)
    n = max(len(da), len(db))
    da += [0] * (n - len(da))
    db += [0] * (n - len(db))
    carry = 0
    steps = []
    for i in range(n):
        s = da[i] + db[i] + carry
        if i == n - 1:
            steps.append(f"{da[i]}+{db[i]}+{carry} = {s}, write {s}")
        else:
            steps.append(f"{da[i]}+{db[i]}+{carry} = {s}, write {s % 10} carry {s // 10}")
            carry = s // 10
    return "; ".join(steps) + ".", a + b


def sub_steps(a, b):
    """Column subtraction a - b with a >= b >= 0. A column that needs a borrow is written with the
    borrowed ten ('15-8-0 = 7, write 7 borrow 1'). Returns (text, difference)."""
    assert a >= b >= 0
    da, db = digits_lsb(a), digits_lsb(b)
    n = len(da)
    db += [0] * (n - len(db))
    borrow = 0
    steps = []
    for i in range(n):
        t = da[i] - db[i] - borrow
        last = i == n - 1
        if t >= 0:
            steps.append(f"{da[i]}-{db[i]}-{borrow} = {t}, write {t}" + ("" if last else " borrow 0"))
            borrow = 0
        else:
            assert not last
            steps.append(f"{10 + da[i]}-{db[i]}-{borrow} = {t + 10}, write {t + 10} borrow 1")
            borrow = 1
    return "; ".join(steps) + ".", a - b


def mul1_steps(a, d):
    """Column multiplication of a (>= 1) by one digit d (>= 1): '7*9+0 = 63, write 3 carry 6'."""
    da = digits_lsb(a)
    carry = 0
    steps = []
    for i, x in enumerate(da):
        p = x * d + carry
        if i == len(da) - 1:
            steps.append(f"{x}*{d}+{carry} = {p}, write {p}")
        else:
            steps.append(f"{x}*{d}+{carry} = {p}, write {p % 10} carry {p // 10}")
            carry = p // 10
    return "; ".join(steps) + ".", a * d


def reason_add(a, b):
    text, s = add_steps(a, b)
    return f"{a} + {b}: {text}\nSo {a} + {b} = {s}.", s


def reason_sub(a, b):
    if a >= b:
        text, d = sub_steps(a, b)
        return f"{a} - {b}: {text}\nSo {a} - {b} = {d}.", d
    text, d = sub_steps(b, a)
    return (f"{b} is larger than {a}, so compute {b} - {a} and negate.\n{b} - {a}: {text}\n"
            f"So {b} - {a} = {d}, and {a} - {b} = {-d}."), -d


def reason_mul(a, b):
    p = a * b
    if a == 0 or b == 0:
        return f"Anything times 0 is 0.\nSo {a} * {b} = 0.", 0
    lines = []
    x, y = a, b  # x is multiplied by the digits of y
    if y >= 10 and x < 10:
        lines.append(f"{a} * {b} = {b} * {a}.")
        x, y = b, a
    if y < 10:
        text, _ = mul1_steps(x, y)
        lines.append(f"{x} * {y}: {text}")
    else:
        y1, y0 = divmod(y, 10)
        if y0 == 0:
            lines.append(f"{x} * {y} = {x} * {y1} * 10.")
            text, p1 = mul1_steps(x, y1)
            lines.append(f"{x} * {y1}: {text}")
            lines.append(f"So {x} * {y1} = {p1}, and {x} * {y} = {p1 * 10}.")
        else:
            lines.append(f"{x} * {y} = {x} * {y0} + {x} * {y1 * 10}.")
            text, p0 = mul1_steps(x, y0)
            lines.append(f"{x} * {y0}: {text}")
            lines.append(f"So {x} * {y0} = {p0}.")
            text, p1 = mul1_steps(x, y1)
            lines.append(f"{x} * {y1}: {text}")
            lines.append(f"So {x} * {y1} = {p1}, and {x} * {y1 * 10} = {p1 * 10}.")
            text, s = add_steps(p0, p1 * 10)
            lines.append(f"{p0} + {p1 * 10}: {text}")
            lines.append(f"So {p0} + {p1 * 10} = {s}.")
    lines.append(f"So {a} * {b} = {p}.")
    return "\n".join(lines), p


# ----------------------------------------------------------------------------------------------
# Phrasings.

ADD_PHRASES = [
    "What is {a} + {b}?", "What's {a} + {b}?", "What is {a} plus {b}?", "Compute {a} plus {b}.",
    "Compute {a} + {b}", "{a} + {b} = ?", "{a}+{b}=?", "{a} + {b}", "Calculate {a} + {b}.",
    "What is the sum of {a} and {b}?", "Add {a} and {b}.", "How much is {a} plus {b}?", "{a} plus {b}?",
    "what is {a}+{b}", "Find {a} + {b}.", "Please add {a} and {b}.", "Sum {a} and {b}.",
    "What do you get if you add {a} and {b}?", "{a} + {b} equals what?", "Evaluate {a} + {b}.",
]
SUB_PHRASES = [
    "What is {a} - {b}?", "What's {a} - {b}?", "What is {a} minus {b}?", "Compute {a} minus {b}.",
    "Compute {a} - {b}", "{a} - {b} = ?", "{a}-{b}=?", "{a} - {b}", "Calculate {a} - {b}.",
    "Subtract {b} from {a}.", "How much is {a} minus {b}?", "{a} minus {b}?", "what is {a}-{b}",
    "Find {a} - {b}.", "What is {a} take away {b}?", "Please subtract {b} from {a}.",
    "What do you get if you subtract {b} from {a}?", "{a} - {b} equals what?", "Evaluate {a} - {b}.",
    "What is the difference {a} - {b}?",
]
MUL_PHRASES = [
    "What is {a}*{b}?", "What is {a} * {b}?", "What's {a} times {b}?", "Compute {a} times {b}",
    "Compute {a} * {b}.", "{a} x {b} = ?", "{a} × {b} = ?", "{a}*{b}=?", "{a} * {b}", "{a} times {b}?",
    "Multiply {a} by {b}.", "What is the product of {a} and {b}?", "Calculate {a}*{b}.",
    "How much is {a} multiplied by {b}?", "what is {a} x {b}", "What is {a} times {b}?",
    "Find {a} * {b}.", "Please multiply {a} and {b}.", "{a} multiplied by {b} equals what?",
    "Evaluate {a} × {b}.",
]

OK_PHRASES = [
    "Reply with just OK.", "Reply with just OK", "Reply with OK.", "Reply with only OK.",
    "Respond with OK and nothing else.", "Just say OK.", "Say OK.", "Answer with OK.",
    "Reply with OK if you can read this.", "Acknowledge with OK.", "Please reply with just OK.",
    "reply with just ok", "Reply only with the word OK.", "Type OK.",
]
EXACT_PHRASES = [
    "Reply with exactly {x}", "Reply with exactly {x}.", "Reply with exactly: {x}", "Reply with exactly \"{x}\".",
    "Reply with just {x}.", "Reply with just \"{x}\"", "Respond with only the word {x}.",
    "Say {x} and nothing else.", "Answer with exactly {x}.", "Please reply with just {x}.",
    "Just say {x}.", "Output exactly {x}, nothing more.", "Reply with the single word {x}.",
    "Respond with exactly '{x}'.", "Say exactly: {x}", "Your reply must be exactly {x}.",
    "Repeat after me: {x}", "reply with exactly {x}", "Write only {x}.", "Echo {x}.",
]

SELF_PHRASES = [
    "Who are you?", "What are you?", "What is your name?", "What's your name?", "Introduce yourself.",
    "Tell me about yourself.", "Which model are you?", "Who are you", "who are you?", "What model is this?",
    "Describe yourself in one sentence.", "Are you a language model?", "Who am I talking to?",
    "What should I call you?", "Identify yourself.",
]

GREETINGS = [
    (["Hello", "Hello!", "Hi", "Hi!", "Hey", "Hey there", "Hello there", "Good morning", "Good evening",
      "hi", "hello"], "Hello! How can I help you today?", "The user greets me."),
    (["Thanks!", "Thank you", "Thank you!", "thanks", "Thanks a lot.", "Great, thanks."],
     "You're welcome!", "The user thanks me."),
]

# Recall facts: (intro phrasings, acknowledgement, question phrasings, answer, reasoning label).
RECALL_KINDS = {
    "name": (["My name is {v}.", "Hi, I'm {v}.", "Hello, my name is {v}.", "I am {v}.", "Call me {v}."],
             "Nice to meet you, {v}!",
             ["What is my name?", "What's my name?", "Do you remember my name?", "Who am I?",
              "What did I say my name was?"],
             "Your name is {v}.", "name"),
    "colour": (["My favourite colour is {v}.", "My favorite color is {v}.", "I love the colour {v}."],
               "Noted: your favourite colour is {v}.",
               ["What is my favourite colour?", "What's my favorite color?", "Which colour do I like?"],
               "Your favourite colour is {v}.", "favourite colour"),
    "city": (["I live in {v}.", "My home town is {v}.", "I am from {v}."],
             "{v} sounds like a nice place.",
             ["Where do I live?", "Which city am I from?", "What is my home town?"],
             "You live in {v}.", "city"),
    "pet": (["My {a} is called {v}.", "I have a {a} named {v}."],
            "{v} is a lovely name for a {a}.",
            ["What is my pet called?", "What is the name of my {a}?", "What did I call my {a}?"],
            "Your {a} is called {v}.", "pet's name"),
    "number": (["Remember the number {v}.", "Please remember this number: {v}.", "My lucky number is {v}.",
                "Keep the number {v} in mind."],
               "OK, I will remember {v}.",
               ["What number did I ask you to remember?", "What was the number?",
                "Which number did I tell you?", "What is my number?"],
               "{v}", "number"),
}


def vary_case(rng, s):
    """Small surface variations of a user message: lowercase start, dropped final punctuation."""
    r = rng.random()
    if r < 0.08 and s[:1].isupper() and not s.startswith("I "):
        s = s[0].lower() + s[1:]
    if rng.random() < 0.08 and s[-1:] in ".?":
        s = s[:-1]
    return s


def pick_operand(rng):
    """0..99 with more two-digit numbers (as a person would ask)."""
    r = rng.random()
    if r < 0.18:
        return rng.randint(0, 9)
    return rng.randint(10, 99)


def random_word(rng):
    r = rng.random()
    if r < 0.70:
        w = rng.choice(WORDS)
    elif r < 0.85:
        w = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 7)))
    else:
        w = rng.choice(WORDS) + str(rng.randint(0, 99))
    c = rng.random()
    if c < 0.2:
        w = w.upper()
    elif c < 0.4:
        w = w.capitalize()
    return w


# ----------------------------------------------------------------------------------------------
# One exchange: (user text, reasoning, answer).


def make_exchange(rng, skill):
    if skill in ("add", "sub", "mul"):
        a, b = pick_operand(rng), pick_operand(rng)
        if skill == "add":
            q = rng.choice(ADD_PHRASES).format(a=a, b=b)
            reasoning, r = reason_add(a, b)
            answer = f"{a} + {b} = {r}"
        elif skill == "sub":
            q = rng.choice(SUB_PHRASES).format(a=a, b=b)
            reasoning, r = reason_sub(a, b)
            answer = f"{a} - {b} = {r}"
        else:
            q = rng.choice(MUL_PHRASES).format(a=a, b=b)
            reasoning, r = reason_mul(a, b)
            answer = f"{a} * {b} = {r}"
        return vary_case(rng, q), reasoning, answer, {"a": a, "b": b, "result": r}
    if skill == "ok":
        if rng.random() < 0.35:
            q = rng.choice(OK_PHRASES)
            return q, "The user wants me to reply with exactly \"OK\".", "OK", {"expected": "OK"}
        x = random_word(rng)
        q = rng.choice(EXACT_PHRASES).format(x=x)
        return q, f"The user wants me to reply with exactly \"{x}\".", x, {"expected": x}
    if skill == "self":
        q = rng.choice(SELF_PHRASES)
        return q, "The user asks who I am. I am kiln-tiny, a small test model served by kiln.", \
            SELF_DESCRIPTION, {"expected": SELF_DESCRIPTION}
    if skill == "greet":
        phrases, answer, reasoning = rng.choice(GREETINGS)
        return rng.choice(phrases), reasoning, answer, {"expected": answer}
    raise ValueError(skill)


def make_recall(rng):
    """A multi-turn conversation: a fact, 0-2 unrelated exchanges, then a question about the fact."""
    kind = rng.choice(list(RECALL_KINDS))
    intros, ack, questions, answer, label = RECALL_KINDS[kind]
    animal = rng.choice(ANIMALS)
    if kind == "name":
        v = rng.choice(NAMES)
    elif kind == "colour":
        v = rng.choice(COLOURS)
    elif kind == "city":
        v = rng.choice(CITIES)
    elif kind == "pet":
        v = rng.choice(NAMES)
    else:
        v = str(rng.choice([rng.randint(0, 99), rng.randint(100, 9999)]))
    fmt = dict(v=v, a=animal)
    messages = [{"role": "user", "content": rng.choice(intros).format(**fmt)},
                {"role": "assistant", "content": ack.format(**fmt)}]
    for _ in range(rng.choice([0, 0, 1, 1, 2])):
        skill = rng.choice(["add", "sub", "mul", "ok", "greet"])
        q, _, a, _ = make_exchange(rng, skill)
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    q = rng.choice(questions).format(**fmt)
    ans = answer.format(**fmt)
    reasoning = f"The user told me their {label} earlier: {v}."
    return messages, q, reasoning, ans, {"kind": kind, "expected": v}


def make_conversation(rng, enable_thinking, skill=None):
    """Returns {"messages": [...], "enable_thinking": bool, "skill": str, "meta": {...}}; the last
    message is the assistant turn to learn (reasoning_content is "" in non-thinking mode)."""
    if skill is None:
        mix = MIX[enable_thinking]
        skill = rng.choices(list(mix), weights=list(mix.values()))[0]
    messages = []
    if rng.random() < 0.12:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    if skill == "recall":
        history, q, reasoning, answer, meta = make_recall(rng)
        messages += history
    else:
        if rng.random() < 0.10:  # an unrelated earlier exchange, rendered as history
            hq, _, ha, _ = make_exchange(rng, rng.choice(["add", "sub", "mul", "ok", "greet", "self"]))
            messages += [{"role": "user", "content": hq}, {"role": "assistant", "content": ha}]
        q, reasoning, answer, meta = make_exchange(rng, skill)
    messages.append({"role": "user", "content": q})
    messages.append({"role": "assistant", "content": answer,
                     "reasoning_content": reasoning if enable_thinking else ""})
    return {"messages": messages, "enable_thinking": enable_thinking, "skill": skill, "meta": meta}


# ----------------------------------------------------------------------------------------------
# Rendering (the Qwen3.5 template, for the message shapes made above).


def render_prompt(messages, enable_thinking):
    """What a server feeds the model: the template rendered with add_generation_prompt=True over
    `messages` (system?, then user/assistant turns, the last one a user turn). Earlier assistant turns
    are history: the template drops their reasoning (they come before the last user query)."""
    out = []
    for i, m in enumerate(messages):
        content = m["content"].strip()
        if m["role"] == "system":
            assert i == 0
            out.append(f"<|im_start|>system\n{content}<|im_end|>\n")
        elif m["role"] == "user":
            out.append(f"<|im_start|>user\n{content}<|im_end|>\n")
        elif m["role"] == "assistant":
            assert i < len(messages) - 1
            out.append(f"<|im_start|>assistant\n{content}<|im_end|>\n")
        else:
            raise ValueError(m["role"])
    assert messages[-1]["role"] == "user"
    out.append("<|im_start|>assistant\n<think>\n")
    if not enable_thinking:
        out.append("\n</think>\n\n")
    return "".join(out)


def completion_text(reasoning, answer, enable_thinking):
    """What the model writes after the generation prompt, up to and including <|im_end|>."""
    if enable_thinking:
        return f"{reasoning.strip()}\n</think>\n\n{answer.strip()}<|im_end|>"
    return f"{answer.strip()}<|im_end|>"


def render_example(conv):
    """(prompt, completion) strings of a conversation made by make_conversation."""
    msgs = conv["messages"]
    last = msgs[-1]
    return (render_prompt(msgs[:-1], conv["enable_thinking"]),
            completion_text(last.get("reasoning_content", ""), last["content"], conv["enable_thinking"]))


_JINJA_TEMPLATE = None


def jinja_template():
    """The chat template compiled the way transformers does (trim_blocks, lstrip_blocks, loopcontrols,
    a sandboxed environment, raise_exception, tojson without ASCII escaping)."""
    global _JINJA_TEMPLATE
    if _JINJA_TEMPLATE is None:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        with open(TEMPLATE_PATH, encoding="utf-8") as f:
            _JINJA_TEMPLATE = env.from_string(f.read())
    return _JINJA_TEMPLATE


def jinja_render(messages, add_generation_prompt, enable_thinking):
    kwargs = {"messages": messages, "add_generation_prompt": add_generation_prompt}
    if not enable_thinking:
        kwargs["enable_thinking"] = False
    return jinja_template().render(**kwargs)


def check_against_jinja(conv):
    """Asserts that the fast renderer agrees with the real template, for the prompt and for the
    whole conversation (prompt + completion + the template's trailing newline)."""
    prompt, completion = render_example(conv)
    msgs = conv["messages"]
    want_prompt = jinja_render(msgs[:-1], True, conv["enable_thinking"])
    if prompt != want_prompt:
        raise AssertionError(f"prompt mismatch:\n{prompt!r}\n{want_prompt!r}")
    want_full = jinja_render(msgs, False, conv["enable_thinking"])
    if prompt + completion + "\n" != want_full:
        raise AssertionError(f"full mismatch:\n{(prompt + completion)!r}\n{want_full!r}")


def generate(seed, n, mode="mix"):
    """n conversations from one seed. mode: 'think', 'direct' or 'mix' (50/50)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if mode == "mix":
            thinking = rng.random() < 0.5
        else:
            thinking = mode == "think"
        out.append(make_conversation(rng, thinking))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--mode", default="mix", choices=["mix", "think", "direct"])
    ap.add_argument("--check", action="store_true", help="check every rendering against jinja2")
    ap.add_argument("--jsonl", action="store_true", help="print conversations as JSON lines")
    args = ap.parse_args()
    for conv in generate(args.seed, args.n, args.mode):
        if args.check:
            check_against_jinja(conv)
        if args.jsonl:
            print(json.dumps(conv, ensure_ascii=False))
        else:
            prompt, completion = render_example(conv)
            sys.stdout.write(f"=== {conv['skill']} thinking={conv['enable_thinking']}\n{prompt}\033[1m{completion}\033[0m\n")
    if args.check:
        print(f"# {args.n} conversations match the jinja2 rendering", file=sys.stderr)


if __name__ == "__main__":
    main()
