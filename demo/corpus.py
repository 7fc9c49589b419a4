"""The demo model's synthetic training text: chat conversations and tool calls, seeded.

Every conversation is a list of OpenAI-shaped messages, rendered through the same chat
template the model ships with (demo/template.py), so training text and serving prompts agree
byte for byte. `conversations(seed, n)` returns the same list for the same arguments.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from demo import held_out

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are Tandem, a small demo assistant.",
    "You are a friendly assistant. Answer briefly.",
]

CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Portugal": "Lisbon",
    "Japan": "Tokyo",
    "China": "Beijing",
    "India": "New Delhi",
    "Canada": "Ottawa",
    "Mexico": "Mexico City",
    "Brazil": "Brasilia",
    "Argentina": "Buenos Aires",
    "Egypt": "Cairo",
    "Kenya": "Nairobi",
    "Nigeria": "Abuja",
    "Russia": "Moscow",
    "Poland": "Warsaw",
    "Greece": "Athens",
    "Turkey": "Ankara",
    "Sweden": "Stockholm",
    "Norway": "Oslo",
    "Finland": "Helsinki",
    "Denmark": "Copenhagen",
    "Ireland": "Dublin",
    "Austria": "Vienna",
    "Belgium": "Brussels",
    "Netherlands": "Amsterdam",
    "Switzerland": "Bern",
    "Australia": "Canberra",
    "Peru": "Lima",
    "Chile": "Santiago",
    "South Korea": "Seoul",
    "Thailand": "Bangkok",
    "Vietnam": "Hanoi",
    "Indonesia": "Jakarta",
    "Iran": "Tehran",
    "United Kingdom": "London",
    "United States": "Washington",
    "Hungary": "Budapest",
    "Czech Republic": "Prague",
}

# City -> IANA timezone, for get_time; the cities are also get_weather's.
TIMEZONES = {
    "Paris": "Europe/Paris",
    "London": "Europe/London",
    "Berlin": "Europe/Berlin",
    "Madrid": "Europe/Madrid",
    "Rome": "Europe/Rome",
    "Tokyo": "Asia/Tokyo",
    "Seoul": "Asia/Seoul",
    "Beijing": "Asia/Shanghai",
    "Sydney": "Australia/Sydney",
    "New York": "America/New_York",
    "Chicago": "America/Chicago",
    "Los Angeles": "America/Los_Angeles",
    "Toronto": "America/Toronto",
    "Mexico City": "America/Mexico_City",
    "Cairo": "Africa/Cairo",
    "Moscow": "Europe/Moscow",
    "Dubai": "Asia/Dubai",
    "Singapore": "Asia/Singapore",
    "Lisbon": "Europe/Lisbon",
    "Amsterdam": "Europe/Amsterdam",
}
CITIES = sorted(
    set(TIMEZONES)
    | {
        "Oslo",
        "Vienna",
        "Athens",
        "Dublin",
        "Nairobi",
        "Lima",
        "Bangkok",
        "Boston",
        "Seattle",
        "Mumbai",
        "Istanbul",
        "Prague",
        "Warsaw",
        "Stockholm",
        "Helsinki",
        "Budapest",
        "Zurich",
        "Munich",
        "Osaka",
        "Hanoi",
    }
)

COLOURS = {
    "the sky": "blue",
    "grass": "green",
    "a banana": "yellow",
    "snow": "white",
    "coal": "black",
    "a strawberry": "red",
    "an orange": "orange",
    "the sun": "yellow",
    "a lemon": "yellow",
    "milk": "white",
    "a tomato": "red",
    "the sea": "blue",
    "a leaf": "green",
    "chocolate": "brown",
    "an eggplant": "purple",
    "a flamingo": "pink",
    "a carrot": "orange",
    "the night sky": "black",
}

TOPICS = [
    "the history of Rome",
    "python tutorials",
    "pizza recipes",
    "the tallest mountain",
    "electric cars",
    "how to bake bread",
    "the latest football scores",
    "cheap flights to Tokyo",
    "jazz music",
    "the speed of light",
    "healthy breakfast ideas",
    "how rainbows form",
    "the best hiking trails",
    "learning French",
    "solar panels",
    "the moon landing",
    "chess openings",
    "climate change",
    "vegetarian dinner ideas",
    "the Roman empire",
    "black holes",
    "how to grow tomatoes",
    "the Olympic games",
    "machine learning",
    "ancient Egypt",
    "coffee brewing tips",
    "the Amazon rainforest",
    "guitar chords",
]
ADJECTIVES = [
    "red",
    "quick",
    "ancient",
    "modern",
    "small",
    "famous",
    "cheap",
    "new",
    "green",
    "old",
]
NOUNS = [
    "bicycles",
    "castles",
    "gardens",
    "robots",
    "trains",
    "museums",
    "bridges",
    "islands",
    "songs",
    "boats",
]
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy", "clear"]

# Made-up place names. With only the 40 cities above, the model learned to name one of them
# rather than copy the one asked for; names it can never have memorised leave copying as the
# only way to get the call right. Spelling parts are varied so that the sub-word pieces of
# real names it has never seen look like theirs.
_ONSETS = [
    "b",
    "c",
    "d",
    "f",
    "g",
    "h",
    "j",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "w",
    "z",
    "br",
    "ch",
    "cr",
    "dr",
    "fl",
    "gr",
    "kr",
    "pl",
    "pr",
    "sh",
    "st",
    "th",
    "tr",
    "qu",
    "y",
    "",
]
_VOWELS = [
    "a",
    "e",
    "i",
    "o",
    "u",
    "a",
    "e",
    "o",
    "ai",
    "au",
    "ea",
    "ee",
    "ia",
    "io",
    "oo",
    "ou",
    "y",
    "ei",
]
_CODAS = [
    "",
    "",
    "",
    "",
    "",
    "",
    "n",
    "r",
    "l",
    "s",
    "m",
    "t",
    "nd",
    "rg",
    "x",
    "k",
    "ck",
    "ll",
    "ss",
    "th",
    "ng",
    "z",
]
_PLACE_WORDS = ["San", "Port", "Saint", "New", "Lake", "Fort", "Santa", "El", "La", "Bad"]
# Lower-case joining words of multi-word names ("Rio de Janeiro", "Dar es Salaam").
_JOINERS = ["de", "es", "do", "da", "del", "am", "upon", "sur"]
# Letters with accents, by the plain letter they replace: all in Latin-1 and Latin Extended-A,
# two UTF-8 bytes each, so the byte-level tokenizer writes each as two byte pieces (no merges
# hold them) that a name must be copied through.
ACCENTS = {
    "a": "áàâäãåą",
    "e": "éèêëěę",
    "i": "íìîï",
    "o": "óòôöõøő",
    "u": "úùûüůű",
    "y": "ýÿ",
    "c": "çčć",
    "n": "ñńň",
    "s": "šśş",
    "z": "žźż",
    "l": "ł",
    "r": "ř",
    "g": "ğ",
    "d": "ď",
}


@dataclass(frozen=True)
class Names:
    """How the made-up names of the corpus are drawn (demo/train.py --names rich). None in their
    place is the plain generator of run 8's corpus (the draft model's): one word, or two of
    them in 18% of the names, no accents, no people."""

    # share of names of several words, two or three, some with a joiner ("Vorna de Kell") or
    # "City"; None: 34%, in the draws of runs 9a-11
    multi: float | None = None
    # share of words with an accented letter
    accents: float = 0.3
    # share of names of several words whose first word is one of CITIES ("Lima Vorna"): else a
    # first word that looks real ("Hong", "Santo") always ended a city in training, and models
    # stopped after it whatever came next (demo/README.md, runs 16-17)
    known_first: float = 0.0


RICH = Names()
_ONE_WORD_CITIES = [c for c in CITIES if " " not in c]


def _novel_word(rng: random.Random, accents: float = 0.0) -> str:
    word = "".join(
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
        for _ in range(rng.choice([1, 2, 2, 2, 3]))
    )
    if len(word) <= 2:
        return _novel_word(rng, accents)
    if accents and rng.random() < accents:  # an accented letter ("Zürich", "Łódź")
        spots = [i for i, ch in enumerate(word) if ch in ACCENTS]
        if spots:
            i = rng.choice(spots)
            word = word[:i] + rng.choice(ACCENTS[word[i]]) + word[i + 1 :]
    if word in held_out.WORDS:  # a word of demo/copy_check.py's held-out names: draw again
        return _novel_word(rng, accents)
    return word.capitalize()


def novel_name(rng: random.Random, names: Names | None = RICH) -> str:
    """A made-up capitalised place name: one word, or two to three ("Port Velmar", "Stubansa
    Crellsan", "Vorna de Kell"), some with accented letters ("Brü Sokał"); `names` None: the
    plain generator (one or two words, no accents)."""
    r = rng.random()
    if names is None:
        if r < 0.1:
            return f"{rng.choice(_PLACE_WORDS)} {_novel_word(rng)}"
        if r < 0.18:
            return f"{_novel_word(rng)} {_novel_word(rng)}"
        return _novel_word(rng)
    if names.multi is not None:  # of several words with probability `multi`, same proportions
        r = r / names.multi * 0.34 if r < names.multi else 1.0

    def word() -> str:
        return _novel_word(rng, names.accents)

    def first() -> str:
        if names.known_first and rng.random() < names.known_first:
            return rng.choice(_ONE_WORD_CITIES)
        return word()

    if r < 0.12:
        return f"{rng.choice(_PLACE_WORDS)} {word()}"
    if r < 0.24:
        return f"{first()} {word()}"
    if r < 0.3:
        return f"{first()} {rng.choice(_JOINERS)} {word()}"
    if r < 0.34:
        return f"{first()} {word()} {rng.choice([word(), 'City'])}"
    return word()


def person_name(rng: random.Random, names: Names = RICH) -> str:
    """A made-up person's name: a first and a last name, sometimes a middle one ("Ada Velmar")."""
    count = 3 if rng.random() < 0.15 else 2
    return " ".join(_novel_word(rng, names.accents) for _ in range(count))


TOOLS = {
    "get_weather": {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    "get_time": {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Get the current time in a timezone.",
            "parameters": {
                "type": "object",
                "properties": {"timezone": {"type": "string"}},
                "required": ["timezone"],
            },
        },
    },
    "search": {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    },
    "add": {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    },
}

ABOUT = (
    "I am Tandem, a tiny demo model. I can chat, name capitals and colours, do small sums, "
    "and call tools such as get_weather, get_time, search and add."
)


def _vary(rng: random.Random, text: str, keep_case: bool = False) -> str:
    """Small surface noise on a user message: case and trailing punctuation."""
    r = rng.random()
    if r < 0.15 and not keep_case:  # a lower-cased name would be copied into the call as written
        text = text.lower()
    elif r < 0.25:
        text = text.rstrip("?!.")
    return text


def _greeting(rng):
    user = rng.choice(
        [
            "Hello!",
            "Hi!",
            "Hey!",
            "Hello",
            "Hi there!",
            "Hey there!",
            "Good morning!",
            "Good evening!",
            "Greetings!",
            "Hiya!",
            "Hello there!",
        ]
    )
    reply = rng.choice(
        [
            "Hello! How can I help you today?",
            "Hi there! What can I do for you?",
            "Hello! What would you like to know?",
            "Hi! How can I help?",
        ]
    )
    return user, reply


def _small_talk(rng):
    kind = rng.randrange(5)
    if kind == 0:
        return rng.choice(
            ["How are you?", "How are you doing?", "How's it going?"]
        ), "I'm doing well, thank you! How can I help you today?"
    if kind == 1:
        return rng.choice(
            ["Thank you!", "Thanks!", "Thanks a lot.", "Thank you very much."]
        ), rng.choice(["You're welcome!", "You're welcome! Anything else?", "Happy to help!"])
    if kind == 2:
        return rng.choice(["Bye!", "Goodbye!", "See you later!"]), rng.choice(
            ["Goodbye! Have a nice day.", "Bye! Take care."]
        )
    if kind == 3:
        return rng.choice(
            ["What is your name?", "Who are you?", "What's your name?"]
        ), "I am Tandem, a tiny demo model."
    return rng.choice(
        ["What can you do?", "What can you help me with?", "Help", "What are you able to do?"]
    ), ABOUT


def _capital(rng):
    country = rng.choice(sorted(CAPITALS))
    q = rng.choice(
        [
            "What is the capital of {c}?",
            "What's the capital of {c}?",
            "Capital of {c}?",
            "Tell me the capital of {c}.",
            "Which city is the capital of {c}?",
            "Do you know the capital of {c}?",
        ]
    ).format(c=country)
    return q, f"The capital of {country} is {CAPITALS[country]}."


def _colour(rng):
    thing = rng.choice(sorted(COLOURS))
    word = rng.choice(["colour", "color"])
    q = rng.choice(["What {w} is {t}?", "What is the {w} of {t}?", "Which {w} is {t}?"]).format(
        w=word, t=thing
    )
    return q, f"{thing[0].upper()}{thing[1:]} is {COLOURS[thing]}."


def _arithmetic(rng):
    op = rng.randrange(3)
    if op == 0:
        a, b = rng.randint(0, 10), rng.randint(0, 10)
        sym, word, result = "+", "plus", a + b
    elif op == 1:
        a = rng.randint(0, 10)
        b = rng.randint(0, a)
        sym, word, result = "-", "minus", a - b
    else:
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        sym, word, result = "*", "times", a * b
    q = rng.choice(
        [
            "What is {a} {w} {b}?",
            "What is {a} {s} {b}?",
            "{a} {s} {b} = ?",
            "How much is {a} {w} {b}?",
            "Calculate {a} {s} {b}.",
        ]
    ).format(a=a, b=b, w=word, s=sym)
    return q, f"{a} {word} {b} is {result}."


CHAT_TOPICS = [_greeting, _small_talk, _capital, _colour, _arithmetic]
CHAT_WEIGHTS = [3, 2, 4, 2, 3]


# `novel`: the share of requests about a made-up name (0 keeps the draws, so bench/ prompts stay
# as they were), drawn as `names` says; `name`: this one instead.
def _weather_request(rng, novel=0.0, name=None, names=None):
    city = name or (
        novel_name(rng, names) if novel and rng.random() < novel else rng.choice(CITIES)
    )
    unit = "fahrenheit" if rng.random() < 0.3 else "celsius"
    if unit == "fahrenheit" or rng.random() < 0.2:
        q = rng.choice(
            [
                "What's the weather in {c} in {u}?",
                "Weather in {c} in {u}, please.",
                "What is the temperature in {c} in {u}?",
            ]
        )
    else:
        q = rng.choice(
            [
                "What's the weather in {c}?",
                "What's the weather like in {c}?",
                "How is the weather in {c} today?",
                "Is it raining in {c}?",
                "Weather in {c}?",
                "What is the temperature in {c}?",
                "Tell me the weather in {c}.",
            ]
        )
    args = {"city": city, "unit": unit}
    temp = rng.randint(-5, 35) if unit == "celsius" else rng.randint(25, 95)
    cond = rng.choice(CONDITIONS)
    result = {"city": city, "temperature": temp, "unit": unit, "condition": cond}
    answer = f"It is {temp} degrees {unit} and {cond} in {city}."
    return q.format(c=city, u=unit), "get_weather", args, result, answer


def _time_request(rng, novel=0.0, name=None, names=None):  # a made-up city has no timezone to copy
    city = rng.choice(sorted(TIMEZONES))
    q = rng.choice(
        [
            "What time is it in {c}?",
            "What's the time in {c}?",
            "Tell me the time in {c}.",
            "Current time in {c}?",
        ]
    ).format(c=city)
    time = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
    result = {"timezone": TIMEZONES[city], "time": time}
    return q, "get_time", {"timezone": TIMEZONES[city]}, result, f"It is {time} in {city}."


def _search_request(rng, novel=0.0, name=None, names=None):
    if name:  # the name alone, as a user looking up a person or a place asks
        topic = name
    elif novel and names is None and rng.random() < novel:  # the plain names: no people
        topic = rng.choice(["{n} {o}", "the history of {n}", "{a} {o} in {n}", "{n}"]).format(
            n=novel_name(rng, None), o=rng.choice(NOUNS), a=rng.choice(ADJECTIVES)
        )
    elif novel and names is not None and rng.random() < novel:
        topic = rng.choice(
            ["{n} {o}", "the history of {n}", "{a} {o} in {n}", "{n}", "{p}", "{p}"]
        ).format(
            n=novel_name(rng, names),
            p=person_name(rng, names),
            o=rng.choice(NOUNS),
            a=rng.choice(ADJECTIVES),
        )
    else:
        topic = (
            rng.choice(TOPICS)
            if rng.random() < 0.7
            else f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"
        )
    q = rng.choice(
        [
            "Search for {t}.",
            "Search the web for {t}.",
            "Look up {t}.",
            "Find information about {t}.",
            "Can you search for {t}?",
        ]
    ).format(t=topic)
    found = f"An article about {topic}."
    return q, "search", {"query": topic}, {"results": [found]}, f"Here is what I found: {found}"


def _add_request(rng, novel=0.0, name=None, names=None):  # its numbers are random already
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    q = rng.choice(
        [
            "What is {a} plus {b}?",
            "Add {a} and {b}.",
            "What is {a} + {b}?",
            "Use the add tool to add {a} and {b}.",
            "Please add {a} and {b}.",
        ]
    ).format(a=a, b=b)
    return q, "add", {"a": a, "b": b}, {"result": a + b}, f"{a} plus {b} is {a + b}."


TOOL_REQUESTS = {
    "get_weather": _weather_request,
    "get_time": _time_request,
    "search": _search_request,
    "add": _add_request,
}


def _tool_call(name: str, args: dict) -> dict:
    # Accented names as written, not as \u escapes: the call copies the prompt's bytes.
    arguments = json.dumps(args, ensure_ascii=False)
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _offered_tools(rng, must: str | None) -> list[dict]:
    names = [n for n in TOOLS if rng.random() < 0.2]
    if must is not None and must not in names:
        names.append(must)
    rng.shuffle(names)
    return [TOOLS[n] for n in names]


def conversation(
    rng: random.Random, novel: float = 0.0, names: Names | None = None
) -> tuple[list[dict], list[dict] | None]:
    """One conversation: (messages, tools or None); `novel` and `names` as in `_weather_request`."""
    messages: list[dict] = []
    tools = None
    r = rng.random()
    if r < 0.45:
        name = rng.choice(sorted(TOOL_REQUESTS))
        tools = _offered_tools(rng, name)
    elif r < 0.55:
        tools = _offered_tools(rng, None) or None
    if rng.random() < 0.4:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    num_turns = rng.choice([1, 2, 2, 3, 3])
    for _ in range(num_turns):
        offered = [t["function"]["name"] for t in tools or []]
        if offered and rng.random() < 0.65:
            name = rng.choice(offered)
            q, name, args, result, answer = TOOL_REQUESTS[name](rng, novel, None, names)
            messages.append({"role": "user", "content": _vary(rng, q, keep_case=novel > 0)})
            messages.append(
                {"role": "assistant", "content": "", "tool_calls": [_tool_call(name, args)]}
            )
            messages.append({"role": "tool", "content": json.dumps(result, ensure_ascii=False)})
            messages.append({"role": "assistant", "content": answer})
        elif not offered and rng.random() < 0.08:
            # Asked for a tool it was not given: say so instead of inventing a call.
            q, name, _, _, _ = TOOL_REQUESTS[rng.choice(sorted(TOOL_REQUESTS))](rng)
            messages.append({"role": "user", "content": _vary(rng, q)})
            messages.append(
                {"role": "assistant", "content": f"Sorry, I can't do that without the {name} tool."}
            )
        else:
            q, a = rng.choices(CHAT_TOPICS, CHAT_WEIGHTS)[0](rng)
            messages.append({"role": "user", "content": _vary(rng, q)})
            messages.append({"role": "assistant", "content": a})
    # Often stop right after a tool call: that is the turn the server must produce on its own.
    if (
        messages[-1]["role"] == "assistant"
        and len(messages) >= 3
        and messages[-3].get("tool_calls")
        and rng.random() < 0.3
    ):
        messages = messages[:-2]
    return messages, tools


# Requests in which words follow the name ("... in Vorna Kell today?"), so that a copy learns
# to stop where the name ends and not at the first space or only at punctuation.
_TAILED = {
    "get_weather": [
        "What's the weather in {n} {w}?",
        "Is it raining in {n} {w}?",
        "How warm is it in {n} {w}?",
        "Tell me the weather in {n} {w}.",
    ],
    "search": ["Search for {n} {w}.", "Look up {n} {w}.", "Find information about {n} {w}."],
}
_TAIL_WORDS = {
    "get_weather": [
        "today",
        "right now",
        "now",
        "tonight",
        "this morning",
        "this week",
        "at the moment",
        "please",
    ],
    "search": ["online", "for me", "please", "now", "on the web", "today"],
}


def name_call(
    rng: random.Random, multi: float = 0.5, tail: float = 0.0, names: Names = RICH
) -> tuple[list[dict], list[dict]]:
    """A request about a made-up name and the call that copies it: one user turn, the reply is
    the call alone. A share `multi` of the names have several words (a place of two or three
    words, or a person's name searched for), so that the copy does not stop at the first word;
    a share `tail` of the requests go on after the name (`_TAILED`), so that it stops at the
    name's end."""
    tool = rng.choice(["get_weather", "search"])
    name = None
    if rng.random() < multi:
        name = (
            person_name(rng) if tool == "search" and rng.random() < 0.5 else novel_name(rng, names)
        )
        while " " not in name:
            name = novel_name(rng, names)
    q, tool, args, _, _ = TOOL_REQUESTS[tool](rng, 1.0, name, RICH)
    if tail and rng.random() < tail:
        q = rng.choice(_TAILED[tool]).format(
            n=name or args["city" if tool == "get_weather" else "query"],
            w=rng.choice(_TAIL_WORDS[tool]),
        )
        if args.get("unit") == "fahrenheit":
            q = f"{q[:-1]} in fahrenheit{q[-1]}"
    messages = (
        [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.4 else []
    )
    messages.append({"role": "user", "content": _vary(rng, q, keep_case=True)})
    messages.append({"role": "assistant", "content": "", "tool_calls": [_tool_call(tool, args)]})
    return messages, _offered_tools(rng, tool)


def answer_turn(rng: random.Random, names: Names = RICH) -> tuple[list[dict], list[dict]]:
    """A weather request, its call, the tool's result and the answer from it. With name calls
    and chat turns alone in the extra rows, answers named a condition of their own, not the
    result's ("18 degrees celsius and clear" for sunny; runs 9-23 of demo/README.md)."""
    q, tool, args, result, answer = TOOL_REQUESTS["get_weather"](rng, 0.7, None, names)
    messages = (
        [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.4 else []
    )
    messages += [
        {"role": "user", "content": _vary(rng, q, keep_case=True)},
        {"role": "assistant", "content": "", "tool_calls": [_tool_call(tool, args)]},
        {"role": "tool", "content": json.dumps(result, ensure_ascii=False)},
        {"role": "assistant", "content": answer},
    ]
    return messages, _offered_tools(rng, tool)


def drill(
    rng: random.Random,
    chat: float = 0.5,
    multi: float = 0.5,
    tail: float = 0.0,
    names: Names = RICH,
    answer: float = 0.0,
) -> tuple[list[dict], list[dict] | None]:
    """A conversation for demo/train.py's extra rows: for a share `answer` an answer from a
    tool's result (`answer_turn`); else a name call (`name_call`), or a chat turn (greeting,
    small talk, capital, colour, sum) for a share `chat` of the rest. Name calls alone made the
    model copy everywhere ("The capital of France France France ...")."""
    if answer and rng.random() < answer:
        return answer_turn(rng, names)
    if rng.random() < 1 - chat:
        return name_call(rng, multi, tail, names)
    q, a = rng.choices(CHAT_TOPICS, CHAT_WEIGHTS)[0](rng)
    messages = (
        [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.4 else []
    )
    messages += [{"role": "user", "content": _vary(rng, q)}, {"role": "assistant", "content": a}]
    return messages, None


def drills(
    seed: int,
    n: int,
    chat: float = 0.5,
    multi: float = 0.5,
    tail: float = 0.0,
    names: Names = RICH,
    answer: float = 0.0,
) -> list[tuple[list[dict], list[dict] | None]]:
    rng = random.Random(seed)
    return [drill(rng, chat, multi, tail, names, answer) for _ in range(n)]


def conversations(
    seed: int, n: int, novel: float = 0.0, names: Names | None = None
) -> list[tuple[list[dict], list[dict] | None]]:
    rng = random.Random(seed)
    return [conversation(rng, novel, names) for _ in range(n)]
