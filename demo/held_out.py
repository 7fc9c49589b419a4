"""The names demo/copy_check.py holds out: real places and people's names that the demo model is
never trained on. demo/corpus.py's made-up words skip every word of these (`WORDS`), so a made-up
name can never teach one of them (its generator once made "Hong"); copy_check.py checks that none
is in what demo/train.py trains on.
"""

from __future__ import annotations

import re

# Real cities absent from the corpus' city, capital, timezone and topic lists.
REAL = [
    "Marseille",
    "Lyon",
    "Porto",
    "Seville",
    "Valencia",
    "Barcelona",
    "Naples",
    "Milan",
    "Florence",
    "Venice",
    "Hamburg",
    "Cologne",
    "Frankfurt",
    "Krakow",
    "Gdansk",
    "Bergen",
    "Gothenburg",
    "Antwerp",
    "Rotterdam",
    "Geneva",
    "Salzburg",
    "Edinburgh",
    "Glasgow",
    "Manchester",
    "Liverpool",
    "Kyoto",
    "Nagoya",
    "Sapporo",
    "Busan",
    "Taipei",
    "Manila",
    "Karachi",
    "Dhaka",
    "Chennai",
    "Casablanca",
    "Tunis",
    "Accra",
    "Lagos",
    "Denver",
    "Austin",
    "Houston",
    "Miami",
    "Atlanta",
    "Vancouver",
    "Montreal",
    "Havana",
    "Bogota",
    "Quito",
    "Montevideo",
    "Auckland",
]
# Not "Buenos Aires" (Argentina's capital in the corpus) nor "Ho Chi Minh City" (the corpus
# has a made-up "Lake Chi") nor "Tel Aviv" (a made-up "Tel").
MULTI_WORD = [
    "Rio de Janeiro",
    "Cape Town",
    "Nizhny Novgorod",
    "Hong Kong",
    "Kuala Lumpur",
    "Port Moresby",
    "Abu Dhabi",
    "Las Vegas",
    "San Francisco",
    "Salt Lake City",
    "Addis Ababa",
    "Dar es Salaam",
    "Phnom Penh",
    "Santo Domingo",
    "Belo Horizonte",
    "Porto Alegre",
    "Saint Petersburg",
    "Kansas City",
    "Baton Rouge",
    "Palma de Mallorca",
]
ACCENTED = [
    "Zürich",
    "São Paulo",
    "Málaga",
    "Kraków",
    "Reykjavík",
    "Orléans",
    "Córdoba",
    "Düsseldorf",
    "Malmö",
    "Tromsø",
    "Łódź",
    "Poznań",
    "Wrocław",
    "Besançon",
    "Nîmes",
    "Genève",
    "Medellín",
    "Cancún",
    "Liège",
    "Győr",
]
PEOPLE = [
    "Ada Lovelace",
    "Marie Curie",
    "Nikola Tesla",
    "Frida Kahlo",
    "Alan Turing",
    "Grace Hopper",
    "Rosalind Franklin",
    "Emmy Noether",
    "Hedy Lamarr",
    "Niels Bohr",
    "Wangari Maathai",
    "Chinua Achebe",
    "Srinivasa Ramanujan",
    "Gabriel García Márquez",
    "Antonín Dvořák",
    "Søren Kierkegaard",
    "Frédéric Chopin",
    "José Saramago",
    "Zoë Wanamaker",
    "Björn Borg",
]
# Place words that occur in the corpus' own names (Mexico City, New York, Los Angeles) or its
# made-up ones ("San Velmar"); a held-out name may hold them, never its other words.
GENERIC = {"city", "new", "san", "santa", "saint", "port", "el", "la", "lake", "fort", "de", "es"}


def _words(name: str) -> list[str]:
    return [w.lower() for w in re.findall(r"[^\W\d_]+", name)]


# Every word of the held-out names, lower-cased, but the generic place words.
WORDS = frozenset(
    w for name in REAL + MULTI_WORD + ACCENTED + PEOPLE for w in _words(name) if w not in GENERIC
)
