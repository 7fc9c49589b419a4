"""Chat, code and tool-call conversations for a real chat model, rendered with its own template.

demo/train_eagle3.py trains a head on `training` prompts; bench/speculative.py measures on
`held_out` ones. Both draw from the same generators, and a prompt's user message decides which
side it falls on (`is_held_out`: a hash of it), so no benchmark prompt is trained on.

Kinds:
- `chat`: open questions (explain, tips, a poem, facts, capitals, how-tos);
- `code`: a function, a fix or a how-to in one of several languages;
- `tool_call`: a system prompt offering three to five tools as JSON and asking for a reply of
  only a JSON call, `{"name": ..., "arguments": {...}}`; the user asks for one of them
  (its arguments are in the request). A template without tool support (SmolLM2's) sees
  the tools only there, as a client that puts tools in the system prompt sends them.
"""

from __future__ import annotations

import hashlib
import json
import random

KINDS = ("chat", "code", "tool_call")

TOPICS = [
    "photosynthesis",
    "gravity",
    "inflation",
    "machine learning",
    "the water cycle",
    "black holes",
    "democracy",
    "vaccines",
    "climate change",
    "the internet",
    "DNA",
    "electricity",
    "volcanoes",
    "the stock market",
    "recycling",
    "sleep",
    "the moon",
    "rainbows",
    "blockchain",
    "the immune system",
    "earthquakes",
    "solar power",
]
ACTIVITIES = [
    "learning a language",
    "running a marathon",
    "saving money",
    "studying for exams",
    "cooking pasta",
    "writing an essay",
    "sleeping better",
    "growing tomatoes",
    "public speaking",
    "staying focused",
    "travelling on a budget",
    "making friends",
]
THINGS = [
    "the ocean",
    "autumn",
    "a cat",
    "the city at night",
    "coffee",
    "mountains",
    "rain",
    "friendship",
    "the stars",
    "a old library",
    "spring flowers",
    "the desert",
]
COUNTRIES = [
    "France",
    "Japan",
    "Brazil",
    "Canada",
    "Kenya",
    "Italy",
    "Australia",
    "Egypt",
    "Mexico",
    "Norway",
    "India",
    "Spain",
    "Germany",
    "Peru",
    "Thailand",
    "Chile",
]
ANIMALS = [
    "octopus",
    "elephant",
    "penguin",
    "honeybee",
    "dolphin",
    "owl",
    "giraffe",
    "shark",
    "kangaroo",
    "tortoise",
    "bat",
    "hummingbird",
]
AUDIENCES = ["a child", "a student", "an expert", "my grandmother", "a beginner"]
FORMS = ["haiku", "limerick", "short story", "song", "riddle", "short speech"]
CHAT = [
    lambda r: f"What is {r.choice(TOPICS)}?",
    lambda r: f"Explain {r.choice(TOPICS)} in simple terms.",
    lambda r: f"Give me three tips for {r.choice(ACTIVITIES)}.",
    lambda r: f"Write a short poem about {r.choice(THINGS)}.",
    lambda r: f"What is the capital of {r.choice(COUNTRIES)}?",
    lambda r: f"Tell me a fun fact about the {r.choice(ANIMALS)}.",
    lambda r: f"Why is {r.choice(TOPICS)} important?",
    lambda r: f"How do I get better at {r.choice(ACTIVITIES)}?",
    lambda r: f"Describe {r.choice(THINGS)} in two sentences.",
    lambda r: f"What should I know before visiting {r.choice(COUNTRIES)}?",
    lambda r: f"Explain {r.choice(TOPICS)} to {r.choice(AUDIENCES)}.",
    lambda r: f"Give me {r.randint(2, 6)} ideas for {r.choice(ACTIVITIES)}.",
    lambda r: f"Write a {r.choice(FORMS)} about {r.choice(THINGS)}.",
    lambda r: f"What are the pros and cons of {r.choice(ACTIVITIES)}?",
    lambda r: f"How are {r.choice(TOPICS)} and {r.choice(TOPICS)} related?",
]

LANGUAGES = ["Python", "JavaScript", "Java", "C", "Go", "Rust", "SQL", "Bash", "C++", "Ruby"]
TASKS = [
    "reverses a string",
    "checks if a number is prime",
    "sums a list of numbers",
    "finds the largest element of an array",
    "counts the vowels in a string",
    "computes the factorial of n",
    "returns the n-th Fibonacci number",
    "removes duplicates from a list",
    "checks if a string is a palindrome",
    "sorts a list of words",
    "converts Celsius to Fahrenheit",
    "reads a file line by line",
]
OPERATIONS = [
    "read a JSON file",
    "loop over a dictionary",
    "define a class",
    "handle errors",
    "format a date",
    "split a string",
    "make an HTTP request",
    "write unit tests",
    "sort a list",
    "use a hash map",
]
CODE = [
    lambda r: f"Write a {r.choice(LANGUAGES)} function that {r.choice(TASKS)}.",
    lambda r: f"How do I {r.choice(OPERATIONS)} in {r.choice(LANGUAGES)}?",
    lambda r: f"Show me {r.choice(LANGUAGES)} code that {r.choice(TASKS)}.",
    lambda r: (
        f"Explain what this Python code does: print(sum(x * x for x in range({r.randint(2, 99)})))"
    ),
    lambda r: (
        f"Write a {r.choice(LANGUAGES)} program that prints the numbers from 1 to {r.randint(5, 50)}."
    ),
]

CITIES = [
    "Paris",
    "Tokyo",
    "London",
    "Berlin",
    "Madrid",
    "Rome",
    "Lisbon",
    "Oslo",
    "Cairo",
    "Lima",
    "Sydney",
    "Toronto",
    "Chicago",
    "Seoul",
    "Mumbai",
    "Nairobi",
    "Dublin",
    "Vienna",
]
ZONES = [
    "Europe/Paris",
    "Asia/Tokyo",
    "America/New_York",
    "Europe/London",
    "Australia/Sydney",
    "America/Los_Angeles",
    "Asia/Kolkata",
    "Africa/Cairo",
]
CURRENCIES = ["USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "INR"]
SYMBOLS = ["AAPL", "MSFT", "GOOG", "AMZN", "TSLA", "NVDA", "META", "IBM"]
NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"]


def _tool(name: str, description: str, **params: str) -> dict:
    return {
        "name": name,
        "description": description,
        "parameters": {
            "type": "object",
            "properties": {k: {"type": v} for k, v in params.items()},
            "required": list(params),
        },
    }


TOOLS = {
    "get_weather": _tool("get_weather", "Current weather in a city", city="string", unit="string"),
    "get_time": _tool("get_time", "Current time in a time zone", timezone="string"),
    "search_web": _tool("search_web", "Search the web", query="string"),
    "add": _tool("add", "Add two numbers", a="number", b="number"),
    "convert_currency": _tool(
        "convert_currency", "Convert money", amount="number", source="string", target="string"
    ),
    "get_stock_price": _tool("get_stock_price", "Latest price of a stock", symbol="string"),
    "send_email": _tool("send_email", "Send an email", to="string", subject="string"),
}
# Per tool: (user message, arguments).
REQUESTS = {
    "get_weather": lambda r: (
        lambda c, u: (f"What's the weather in {c} in {u}?", {"city": c, "unit": u})
    )(r.choice(CITIES), r.choice(["celsius", "fahrenheit"])),
    "get_time": lambda r: (lambda z: (f"What time is it in {z}?", {"timezone": z}))(
        r.choice(ZONES)
    ),
    "search_web": lambda r: (lambda q: (f"Search the web for {q}.", {"query": q}))(
        f"{r.choice(TOPICS)} {r.choice(['news', 'history', 'facts', 'explained'])}"
    ),
    "add": lambda r: (lambda a, b: (f"Use the add tool: what is {a} plus {b}?", {"a": a, "b": b}))(
        r.randint(2, 999), r.randint(2, 999)
    ),
    "convert_currency": lambda r: (
        lambda n, s, t: (f"Convert {n} {s} to {t}.", {"amount": n, "source": s, "target": t})
    )(r.randint(5, 5000), *r.sample(CURRENCIES, 2)),
    "get_stock_price": lambda r: (lambda s: (f"What is the stock price of {s}?", {"symbol": s}))(
        r.choice(SYMBOLS)
    ),
    "send_email": lambda r: (
        lambda to, s: (f"Email {to} with the subject '{s}'.", {"to": to, "subject": s})
    )(
        f"{r.choice(NAMES)}@example.com",
        f"{r.choice(['Meeting', 'Lunch', 'Report', 'Trip'])} {r.choice(['today', 'tomorrow', 'on Friday'])}",
    ),
}


AGENT_EXAMPLE = ("What time is it in Asia/Tokyo?", {"timezone": "Asia/Tokyo"})


def tool_system_prompt(tools: list[dict]) -> str:
    listed = "\n".join(json.dumps(t) for t in tools)
    return (
        "You are a helpful assistant with access to these tools:\n"
        f"{listed}\n"
        'To call a tool, reply with only a JSON object: {"name": "<tool name>", "arguments": '
        "{<argument name>: <value>}}. Do not add any other text."
    )


def conversation(kind: str, rng: random.Random, agent: bool = False) -> list[dict]:
    """One conversation of `kind`, cut before the assistant's reply. A tool call offers a few of
    the tools in random order, with a random worked call; `agent`: every tool and the same
    worked call each time, as an agent's requests share their system prompt (the prefix cache
    then serves it)."""
    if kind == "chat":
        return [{"role": "user", "content": rng.choice(CHAT)(rng)}]
    if kind == "code":
        return [{"role": "user", "content": rng.choice(CODE)(rng)}]
    name = rng.choice(sorted(REQUESTS))
    asked, _ = REQUESTS[name](rng)
    if agent:
        offered = [TOOLS[t] for t in sorted(TOOLS)]
        example, (q, args) = "get_time", AGENT_EXAMPLE
    else:
        others = rng.sample([t for t in sorted(TOOLS) if t != name], rng.randint(2, 4))
        offered = [TOOLS[t] for t in rng.sample([name, *others], len(others) + 1)]
        example = rng.choice([t["name"] for t in offered if t["name"] != name])
        q, args = REQUESTS[example](rng)
    # One worked call as an earlier turn: a 135M model follows a shown call, not a described one.
    call = json.dumps({"name": example, "arguments": args})
    return [
        {"role": "system", "content": tool_system_prompt(offered)},
        {"role": "user", "content": q},
        {"role": "assistant", "content": call},
        {"role": "user", "content": asked},
    ]


def is_held_out(messages: list[dict]) -> bool:
    """One user message in eight is the benchmark's, never trained on."""
    text = messages[-1]["content"].encode()
    return hashlib.blake2b(text, digest_size=4).digest()[0] % 8 == 0


def _draw(kind: str, n: int, seed: int, held_out: bool, agent: bool | None) -> list[list[dict]]:
    """`agent` None: a third of the tool calls as an agent sends them, the rest varied."""
    rng, out, seen = random.Random(seed), [], set()
    for _ in range(200 * n):  # the held-out side is an eighth of the space: enough tries
        if len(out) == n:
            break
        messages = conversation(kind, rng, rng.random() < 0.3 if agent is None else agent)
        key = json.dumps(messages)
        if is_held_out(messages) == held_out and key not in seen:
            seen.add(key)
            out.append(messages)
    return out


def training(n: int, seed: int, mix: dict[str, float] | None = None) -> list[list[dict]]:
    """`n` training conversations in the proportions of `mix` (kind -> weight; even by default),
    none held out."""
    mix = mix or dict.fromkeys(KINDS, 1.0)
    total = sum(mix.values())
    counts = {kind: round(n * w / total) for kind, w in mix.items()}
    drawn = [
        m
        for kind, c in counts.items()
        for m in _draw(kind, c, seed + KINDS.index(kind), False, None)
    ]
    random.Random(seed).shuffle(drawn)
    return drawn


def held_out(kind: str, n: int, seed: int = 0) -> list[list[dict]]:
    """Up to `n` distinct held-out conversations of `kind`; tool calls as an agent sends them
    (every tool, one system prompt)."""
    return _draw(kind, n, 1000 + seed + KINDS.index(kind), True, agent=True)


def render(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt's token ids in the model's own chat template, ready for its reply."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(text)
