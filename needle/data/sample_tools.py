"""The synthetic sample's tool catalogue: typed tools, value pools and query phrasings.

``CATALOGUE`` holds every tool (string, integer, number, boolean and enum parameters), each with
several query templates; ``BASE_TOOLS`` train the base model, ``NEW_TOOLS`` are held out for
fine-tuning. ``fill(tool, rng)`` draws one phrasing with its values and the call's arguments.
Single-turn rows (needle/data/sample.py) and conversations (needle/data/sample_conversations.py)
are both built from it.

    query, arguments, template = fill(NEW_TOOLS[0], random.Random(0))
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

Value = Any
Pool = Callable[[random.Random], Value]


def _pick(*options: Value) -> Pool:
    return lambda rng: rng.choice(options)


def _ints(lo: int, hi: int) -> Pool:
    return lambda rng: rng.randint(lo, hi)


def _money(rng: random.Random) -> Value:
    # Either a whole amount or one with cents; whole floats would print as "20.0".
    return rng.randint(5, 900) if rng.random() < 0.5 else rng.randint(501, 99999) / 100


def _halves(lo: int, hi: int) -> Pool:
    def draw(rng: random.Random) -> Value:
        v = rng.randint(lo * 2, hi * 2) / 2
        return int(v) if v.is_integer() else v

    return draw


def _date(rng: random.Random) -> str:
    if rng.random() < 0.4:
        return rng.choice(["today", "tomorrow", "next Monday", "this Friday", "next Tuesday", "Saturday"])
    month = rng.choice(["January", "March", "April", "May", "June", "July", "August", "October", "December"])
    return f"{month} {rng.randint(1, 28)}"


def _time(rng: random.Random) -> str:
    if rng.random() < 0.3:
        return f"{rng.randint(6, 22)}:{rng.choice(['00', '15', '30', '45'])}"
    return f"{rng.randint(1, 12)}{rng.choice(['', ':30', ':15'])} {rng.choice(['am', 'pm'])}"


NAMES = _pick("Alice", "Bob", "Carmen", "Dmitri", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kofi", "Lena", "Mateo", "Nora", "Priya", "Sam")  # fmt: skip
CITIES = _pick("Paris", "Tokyo", "Berlin", "Lagos", "Lima", "Oslo", "Toronto", "Madrid", "Cairo", "Sydney", "Denver", "Seoul", "Dublin", "Chicago", "Mumbai", "Zurich")  # fmt: skip
ROOMS = _pick("kitchen", "bedroom", "living room", "office", "garage", "hallway", "bathroom", "nursery")
CURRENCIES = ("USD", "EUR", "GBP", "JPY", "CHF", "INR")
PLACES = _pick("the airport", "Central Station", "the museum", "City Hospital", "the mall", "Union Square", "the stadium", "Oak Street 12", "the library", "Harbor Park")  # fmt: skip
TASKS = _pick("call mom", "buy milk", "take my pills", "water the plants", "pay rent", "walk the dog", "back up my laptop", "book a dentist visit", "send the report")  # fmt: skip
MESSAGES = _pick("I'm running late", "dinner is at 8", "see you at the gym", "the meeting moved to Friday", "can you pick up bread", "happy birthday!", "I landed safely", "call me when you can")  # fmt: skip


@dataclass(frozen=True)
class Param:
    name: str
    type: str  # JSON-schema type, or "enum" (a string with the allowed values)
    pool: Pool
    required: bool = True
    enum: tuple[str, ...] = ()


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    params: tuple[Param, ...]
    # (query template with {param} slots, arguments fixed by the wording: booleans, enums)
    templates: tuple[tuple[str, dict[str, Value]], ...] = field(default=())

    def schema(self) -> dict[str, Any]:
        props: dict[str, Any] = {}
        for p in self.params:
            props[p.name] = {"type": "string", "enum": list(p.enum)} if p.type == "enum" else {"type": p.type}
        required = [p.name for p in self.params if p.required]
        return {"name": self.name, "description": self.description,
                "parameters": {"type": "object", "properties": props, "required": required}}  # fmt: skip


def _enum(name: str, values: tuple[str, ...], required: bool = True) -> Param:
    return Param(name, "enum", _pick(*values), required, values)


def _tool(name: str, description: str, params: list[Param], *templates: str | tuple[str, dict[str, Value]]) -> Tool:
    normal = tuple((t, {}) if isinstance(t, str) else t for t in templates)
    return Tool(name, description, tuple(params), normal)


S, I, N, B = "string", "integer", "number", "boolean"
CATALOGUE: tuple[Tool, ...] = (
    _tool("set_lights", "Switch or dim the lights in a room",
          [Param("room", S, ROOMS), Param("on", B, _pick(True)), Param("brightness", I, _ints(5, 100), False)],
          ("Turn on the {room} lights", {"on": True}), ("Switch off the lights in the {room}", {"on": False}),
          ("Set the {room} lights to {brightness} percent", {"on": True}), ("Lights off in the {room} please", {"on": False}),
          ("Dim the {room} lights to {brightness}%", {"on": True})),
    _tool("send_email", "Send an email",
          [Param("to", S, _pick("ana@mail.com", "bob.lee@work.org", "team@acme.io", "prof.kim@uni.edu", "sales@shop.net")),
           Param("subject", S, _pick("the budget", "Monday's meeting", "holiday plans", "the new contract", "lunch")),
           Param("body", S, MESSAGES, False)],
          "Email {to} about {subject}", "Send an email to {to} with the subject {subject}",
          "Write to {to} about {subject} and say {body}"),
    _tool("create_event", "Add an event to the calendar",
          [Param("title", S, _pick("dentist", "team standup", "yoga class", "Sara's party", "project review", "parent meeting")),
           Param("date", S, _date), Param("time", S, _time, False)],
          "Add {title} to my calendar on {date}", "Schedule {title} for {date} at {time}",
          "Put {title} in my calendar {date} at {time}"),
    _tool("get_weather", "Current weather for a city",
          [Param("city", S, CITIES), _enum("unit", ("celsius", "fahrenheit"), False)],
          "What's the weather in {city}?", "How warm is it in {city} in {unit}?", "Weather for {city} please",
          "Is it raining in {city} right now?"),
    _tool("set_timer", "Start a countdown timer",
          [Param("minutes", I, _ints(1, 90)), Param("label", S, _pick("pasta", "laundry", "tea", "oven", "nap"), False)],
          "Set a timer for {minutes} minutes", "Start a {minutes} minute timer for the {label}",
          "Timer for {minutes} minutes", "Count down {minutes} minutes for my {label}"),
    _tool("convert_currency", "Convert money between currencies",
          [Param("amount", N, _money), _enum("from_currency", CURRENCIES), _enum("to_currency", CURRENCIES)],
          "Convert {amount} {from_currency} to {to_currency}", "How much is {amount} {from_currency} in {to_currency}?",
          "What is {amount} {from_currency} worth in {to_currency}?"),
    _tool("play_music", "Play music by an artist",
          [Param("artist", S, _pick("Miles Davis", "Adele", "Daft Punk", "Bach", "Fela Kuti", "Taylor Swift", "Queen")),
           Param("shuffle", B, _pick(True), False)],
          "Play some {artist}", "Put on music by {artist}", ("Play {artist} on shuffle", {"shuffle": True}),
          "I want to listen to {artist}"),
    _tool("get_directions", "Route to a destination",
          [Param("destination", S, PLACES), _enum("mode", ("car", "foot", "bus", "bike"), False)],
          "How do I get to {destination}?", "Directions to {destination} by {mode}", "Navigate to {destination}",
          "Take me to {destination} by {mode}"),
    _tool("create_note", "Save a text note",
          [Param("text", S, _pick("buy a new charger", "the wifi code is 4471", "ideas for the garden", "Tom owes me 20 euros")),
           Param("title", S, _pick("home", "work", "misc", "money"), False)],
          "Make a note: {text}", "Write down that {text}", "Create a note titled {title} saying {text}"),
    _tool("set_reminder", "Remind the user at a time",
          [Param("text", S, TASKS), Param("time", S, _time)],
          "Remind me to {text} at {time}", "At {time} remind me to {text}", "Set a reminder for {time} to {text}"),
    _tool("set_thermostat", "Set the home temperature",
          [Param("temperature", N, _halves(16, 28)), _enum("mode", ("heat", "cool", "auto"), False)],
          "Set the thermostat to {temperature} degrees", ("Heat the house to {temperature} degrees", {"mode": "heat"}),
          "Set the thermostat to {mode} at {temperature}", ("Cool it down to {temperature} degrees", {"mode": "cool"})),
    _tool("translate_text", "Translate text to a language",
          [Param("text", S, _pick("good morning", "where is the station", "thank you very much", "I love this city", "how much is it")),
           Param("target_language", S, _pick("French", "Spanish", "German", "Japanese", "Italian", "Swahili"))],
          "Translate \"{text}\" into {target_language}", "How do you say {text} in {target_language}?",
          "What is \"{text}\" in {target_language}?"),
    _tool("get_stock_price", "Latest stock price",
          [Param("symbol", S, _pick("AAPL", "MSFT", "GOOG", "TSLA", "AMZN", "NVDA", "IBM", "SAP"))],
          "What's {symbol} trading at?", "Stock price of {symbol}", "How is {symbol} doing today?"),
    _tool("search_flights", "Find flights on a date",
          [Param("origin", S, CITIES), Param("destination", S, CITIES), Param("date", S, _date)],
          "Find flights from {origin} to {destination} on {date}", "I need to fly {origin} to {destination} {date}",
          "Any flights to {destination} from {origin} on {date}?"),
    _tool("find_recipe", "Search recipes by ingredient",
          [Param("ingredient", S, _pick("chicken", "tofu", "lentils", "salmon", "mushrooms", "eggplant", "rice")),
           Param("max_minutes", I, _ints(10, 60), False)],
          "Find a recipe with {ingredient}", "What can I cook with {ingredient} in under {max_minutes} minutes?",
          "Give me a {ingredient} recipe"),
    _tool("send_message", "Send a chat message",
          [Param("contact", S, NAMES), Param("text", S, MESSAGES)],
          "Text {contact} that {text}", "Send a message to {contact}: {text}", "Tell {contact} \"{text}\""),
    _tool("set_alarm", "Set a wake-up alarm",
          [Param("time", S, _time), Param("repeat", B, _pick(True), False)],
          "Wake me up at {time}", "Set an alarm for {time}", ("Set a daily alarm at {time}", {"repeat": True})),
    _tool("call_contact", "Phone a contact", [Param("name", S, NAMES)], "Call {name}", "Phone {name} please", "Ring {name} now"),
    _tool("add_to_list", "Add an item to the shopping list",
          [Param("item", S, _pick("eggs", "oat milk", "batteries", "apples", "coffee", "dish soap")),
           Param("quantity", I, _ints(2, 12), False)],
          "Add {item} to my shopping list", "Put {quantity} {item} on the shopping list", "We need {item}, add it to the list"),
    _tool("get_news", "Latest headlines on a topic",
          [Param("topic", S, _pick("climate", "football", "the election", "space", "AI", "the economy")),
           Param("count", I, _ints(2, 10), False)],
          "What's the latest news on {topic}?", "Give me {count} headlines about {topic}", "News about {topic}"),
    _tool("check_calendar", "List events on a date", [Param("date", S, _date)],
          "What's on my calendar {date}?", "Am I free on {date}?", "Show my schedule for {date}"),
    # Held out (NEW_TOOLS) from here on.
    _tool("book_taxi", "Book a taxi",
          [Param("origin", S, PLACES), Param("destination", S, PLACES)],
          "Book a taxi from {origin} to {destination}", "Get me a cab to {destination} from {origin}",
          "I need a ride from {origin} to {destination}"),
    _tool("set_volume", "Set the volume", [Param("percent", I, _ints(0, 100))],
          "Set the volume to {percent} percent", "Volume {percent} please", "Turn the sound to {percent}%"),
    _tool("lock_door", "Lock a door",
          [_enum("door", ("front", "back", "garage")), Param("locked", B, _pick(True))],
          ("Lock the {door} door", {"locked": True}), ("Unlock the {door} door", {"locked": False}),
          ("Please make sure the {door} door is locked", {"locked": True})),
    _tool("order_food", "Order food",
          [Param("dish", S, _pick("pizza", "dumplings", "tacos", "salad", "ramen")),
           Param("place", S, _pick("Luigi's", "Golden Wok", "Taco Loco", "Green Bowl")), Param("quantity", I, _ints(2, 6), False)],
          "Order {dish} from {place}", "Get me {quantity} {dish} from {place}", "I'd like {dish} from {place}"),
    _tool("get_tip", "Tip on a bill",
          [Param("amount", N, _money), Param("percent", I, _ints(10, 25))],
          "What's a {percent}% tip on {amount} dollars?", "Calculate a {percent} percent tip for a bill of {amount}",
          "Tip {percent} percent on {amount}"),
    _tool("get_time", "Local time in a city", [Param("city", S, CITIES)],
          "What time is it in {city}?", "Current time in {city}", "Tell me the time in {city}"),
    _tool("search_web", "Search the web",
          [Param("text", S, _pick("best hiking boots", "how tall is Everest", "python list sort", "bus 42 timetable", "cheap hotels in Rome"))],
          "Search the web for {text}", "Look up {text}", "Google {text} for me"),
    _tool("start_workout", "Log a workout",
          [Param("activity", S, _pick("running", "cycling", "yoga", "rowing")), Param("minutes", I, _ints(10, 90))],
          "Start a {minutes} minute {activity} workout", "Track {activity} for {minutes} minutes",
          "Log {minutes} minutes of {activity}"),
    _tool("set_fan", "Set fan speed 1-5", [Param("room", S, ROOMS), Param("speed", I, _ints(1, 5))],
          "Set the {room} fan to speed {speed}", "Turn the fan in the {room} to {speed}"),
    _tool("book_table", "Book a table",
          [Param("place", S, _pick("Luigi's", "Golden Wok", "Chez Marie", "Sakura")), Param("people", I, _ints(2, 8)),
           Param("time", S, _time)],
          "Book a table for {people} at {place} at {time}", "Reserve {place} for {people} people at {time}"),
    _tool("track_package", "Track a package",
          [Param("code", S, lambda rng: f"{rng.choice('ZXQPK')}{rng.randint(10000, 99999)}")],
          "Where is my package {code}?", "Track parcel {code}", "Status of shipment {code}"),
)  # fmt: skip
_N_BASE = 21
BASE_TOOLS: tuple[Tool, ...] = CATALOGUE[:_N_BASE]
NEW_TOOLS: tuple[Tool, ...] = CATALOGUE[_N_BASE:]
_NEW_NAMES = frozenset(t.name for t in NEW_TOOLS)
MAX_NEW_OFFERED = 2
JOINERS = ("{a} and {b}", "{a}, then {b}", "{a}. Also {b}", "{a} and after that {b}")


def fill(tool: Tool, rng: random.Random) -> tuple[str, dict[str, Value], str]:
    """One phrasing of ``tool`` with values drawn, the call arguments, and the template."""
    template, fixed = rng.choice(tool.templates)
    values: dict[str, Value] = {}
    for p in tool.params:
        if "{" + p.name + "}" not in template:
            continue
        # Two slots drawn from one pool (origin/destination) must differ.
        taken = [values[q.name] for q in tool.params if q.name in values and q.pool is p.pool]
        value = p.pool(rng)
        for _ in range(8):
            if value not in taken:
                break
            value = p.pool(rng)
        values[p.name] = value
    args = {p.name: values.get(p.name, fixed.get(p.name)) for p in tool.params}
    args = {k: v for k, v in args.items() if v is not None}
    return template.format(**values), args, template

