"""A small made-up world, generated from a seed, that the tasks ask about and the tools read.

The world is data: regions, towns, companies, people and services with numbers and names that
exist nowhere else, so a model can only know them from training or from its tools. It renders
as a document corpus (what `web_search` searches) and as small files (what `read_file` reads).
The world of seed 0 ships as `rollmarket/data/world/world.json`; `load_world()` reads it.
"""

from __future__ import annotations

import json
import random
import re
from functools import lru_cache
from importlib import resources

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_SEED = 0
SHIPPED = "data/world/world.json"

_ONSETS = ["b", "br", "d", "dr", "f", "g", "gr", "h", "k", "kr", "l", "m", "n", "p", "r", "s", "st", "t",
           "th", "v", "w", "z"]
_VOWELS = ["a", "e", "i", "o", "u", "au", "ei", "y"]
_CODAS = ["", "", "l", "n", "r", "s", "m", "nd", "rt", "sk"]
_TOWN_ENDS = ["holt", "by", "wick", "mere", "ford", "dal", "stead", "ham", "thorpe", "vik"]
_FIRST_NAMES = ["Ilse", "Tomas", "Aurel", "Brina", "Casimir", "Dagny", "Edvin", "Freya", "Gunnar", "Hedda",
                "Ivo", "Jorun", "Kasper", "Linnea", "Magnus", "Nora", "Oskar", "Petra", "Rune", "Sigrid",
                "Teodor", "Ulla", "Vidar", "Wenke", "Yrsa", "Anselm", "Berit", "Corvin"]
_COMPANY_KINDS = ["Mills", "Works", "Foundry", "Textiles", "Brewery", "Shipping", "Instruments", "Ceramics"]
_OCCUPATIONS = ["engineer", "teacher", "brewer", "cartographer", "physician", "architect", "sailor",
                "librarian", "glassblower", "astronomer"]
_SERVICE_WORDS = ["kestrel", "heron", "otter", "lynx", "marten", "plover", "badger", "wren", "falcon", "stoat",
                  "ember", "quill", "cinder", "harbor", "lantern", "meadow", "copper", "slate"]
_ITEMS = ["crates", "barrels", "spools", "lanterns", "ropes", "anvils"]


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True)


class Region(_Record):
    name: str = Field(description="Region name.")
    capital: str = Field(description="Name of the town that is the region's capital.")


class Town(_Record):
    name: str = Field(description="Town name (unique in the world).")
    region: str = Field(description="Name of the region the town lies in.")
    population: int = Field(description="Number of inhabitants.")
    founded: int = Field(description="Year the town was founded.")
    mayor: str = Field(description="Full name of the mayor (a person of the world).")


class Company(_Record):
    name: str = Field(description="Company name (unique).")
    town: str = Field(description="Town where the company is based.")
    founder: str = Field(description="Full name of the founder (a person of the world).")
    founded: int = Field(description="Year the company was founded.")
    employees: int = Field(description="Number of employees.")
    stock: dict[str, int] = Field(description="Warehouse stock by item, written to notes/<slug>.txt.")


class Person(_Record):
    name: str = Field(description="Full name (unique).")
    born: int = Field(description="Year of birth.")
    town: str = Field(description="Town the person lives in.")
    occupation: str = Field(description="Occupation, one word.")


class Service(_Record):
    name: str = Field(description="Service name; its config is config/<name>.toml.")
    port: int = Field(description="TCP port.")
    workers: int = Field(description="Worker count.")
    timeout: int = Field(description="Timeout in seconds.")
    owner: str = Field(description="Full name of the owner (a person of the world).")


class Doc(_Record):
    id: str = Field(description="Stable document id, e.g. 'town-varnholt'.")
    title: str = Field(description="The entity's name.")
    text: str = Field(description="A few sentences about the entity.")


class World(_Record):
    seed: int = Field(description="Seed the world was generated from.")
    regions: list[Region]
    towns: list[Town]
    companies: list[Company]
    people: list[Person]
    services: list[Service]
    docs: list[Doc] = Field(description="The search corpus: one document per region, town, company and person.")
    files: dict[str, str] = Field(description="Files by relative path: config/*.toml and notes/*.txt.")

    def town(self, name: str) -> Town:
        return next(t for t in self.towns if t.name == name)

    def company(self, name: str) -> Company:
        return next(c for c in self.companies if c.name == name)

    def person(self, name: str) -> Person:
        return next(p for p in self.people if p.name == name)


def slug(name: str) -> str:
    """'Brellwick Mills' -> 'brellwick-mills'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _unique(rng: random.Random, make, n: int, taken: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        name = make(rng)
        if name not in taken:
            taken.add(name)
            out.append(name)
    return out


def _stem(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))


def generate_world(seed: int = DEFAULT_SEED, *, n_regions: int = 6, n_towns: int = 150, n_companies: int = 100,
                   n_people: int = 200, n_services: int = 40) -> World:
    """Generate the world of `seed` (same seed, same world, on every platform).

    Large enough (about 2,000 distinct lookup questions) that a model cannot memorise the
    answers of its training tasks and has to read them from its tools.
    """
    rng = random.Random(seed)
    taken: set[str] = set()
    region_names = _unique(rng, lambda r: _stem(r, 2).capitalize() + "mark", n_regions, taken)
    town_names = _unique(rng, lambda r: _stem(r, 1).capitalize() + r.choice(_TOWN_ENDS), n_towns, taken)
    firsts = rng.sample(_FIRST_NAMES, len(_FIRST_NAMES))
    surnames = _unique(rng, lambda r: _stem(r, 2).capitalize(), n_people, taken)
    person_names = [f"{firsts[i % len(firsts)]} {surnames[i]}" for i in range(n_people)]

    people = [Person(name=n, born=rng.randint(1920, 1995), town=rng.choice(town_names),
                     occupation=rng.choice(_OCCUPATIONS)) for n in person_names]
    towns = [Town(name=t, region=region_names[i % n_regions], population=rng.randint(1200, 98000),
                  founded=rng.randint(1150, 1890), mayor=rng.choice(person_names)) for i, t in enumerate(town_names)]
    regions = [Region(name=r, capital=next(t.name for t in towns if t.region == r)) for r in region_names]
    company_names = _unique(rng, lambda r: f"{_stem(r, 2).capitalize()} {r.choice(_COMPANY_KINDS)}", n_companies, taken)
    companies = [Company(name=c, town=rng.choice(town_names), founder=rng.choice(person_names),
                         founded=rng.randint(1850, 2010), employees=rng.randint(20, 4800),
                         stock={item: rng.randint(10, 990) for item in rng.sample(_ITEMS, 3)})
                 for c in company_names]
    services = [Service(name=s, port=rng.randint(2000, 9999), workers=rng.randint(2, 32),
                        timeout=rng.randint(5, 120), owner=rng.choice(person_names))
                for s in _unique(rng, lambda r: f"{r.choice(_SERVICE_WORDS)}-{r.randint(1, 99)}", n_services, taken)]
    docs = _render_docs(regions, towns, companies, people)
    files = _render_files(companies, services)
    return World(seed=seed, regions=regions, towns=towns, companies=companies, people=people,
                 services=services, docs=docs, files=files)


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _render_docs(regions: list[Region], towns: list[Town], companies: list[Company], people: list[Person]) -> list[Doc]:
    docs = [Doc(id=f"region-{slug(r.name)}", title=r.name,
                text=f"{r.name} is a region. Its capital is {r.capital}.") for r in regions]
    docs += [Doc(id=f"town-{slug(t.name)}", title=t.name,
                 text=(f"{t.name} is a town in {t.region}. It was founded in {t.founded} and has a population "
                       f"of {t.population}. Its mayor is {t.mayor}.")) for t in towns]
    docs += [Doc(id=f"company-{slug(c.name)}", title=c.name,
                 text=(f"{c.name} is a company based in {c.town}. It was founded in {c.founded} by {c.founder} "
                       f"and has {c.employees} employees.")) for c in companies]
    docs += [Doc(id=f"person-{slug(p.name)}", title=p.name,
                 text=f"{p.name} is {_article(p.occupation)} {p.occupation} from {p.town}, born in {p.born}.") for p in people]
    return docs


def _render_files(companies: list[Company], services: list[Service]) -> dict[str, str]:
    files = {f"config/{s.name}.toml": (f'[service]\nname = "{s.name}"\nport = {s.port}\nworkers = {s.workers}\n'
                                       f'timeout = {s.timeout}\nowner = "{s.owner}"\n') for s in services}
    for c in companies:
        lines = [f"Stock at {c.name}"] + [f"{item}: {count}" for item, count in c.stock.items()]
        files[f"notes/{slug(c.name)}.txt"] = "\n".join(lines) + "\n"
    return files


def world_json(world: World) -> str:
    """The canonical JSON the shipped world file holds."""
    return json.dumps(world.model_dump(mode="json"), indent=1, sort_keys=True, ensure_ascii=False) + "\n"


@lru_cache(maxsize=1)
def load_world() -> World:
    """The shipped world (seed 0), from package data."""
    text = resources.files("rollmarket").joinpath(SHIPPED).read_text()
    return World.model_validate_json(text)
