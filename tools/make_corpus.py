"""Generate the corpus the tiny tokenizer is trained on.

Run once; the output is committed (services/common/corpus/arithmetic_gsm8k_style.txt)
so building a tiny model never depends on this script, the network or a dataset.
Everything here is synthetic: arithmetic drills, GSM8K-style word problems with
step-by-step solutions ending in `#### N` (with and without `<<a*b=c>>`
calculator annotations), the same problems wrapped in chat turns with the
`<|im_start|>` / `<|im_end|>` role markers, and short plain sentences for
ordinary English, punctuation and a little non-ASCII (a typographic apostrophe, "€", "°").

    python tools/make_corpus.py            # writes the default file
    python tools/make_corpus.py --check    # exits 1 if the committed file differs
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "services/common/corpus/arithmetic_gsm8k_style.txt"
SEED = 20240601
TARGET_BYTES = 320_000

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SYSTEMS = [
    "You are a helpful assistant.",
    "You are a careful math tutor. Show your work.",
    "You solve grade school math problems step by step.",
]

NAMES = [
    "Ada", "Ben", "Carla", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jamal",
    "Kofi", "Lena", "Mateo", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara",
    "Umar", "Vera", "Wen", "Ximena", "Yusuf", "Zoe", "Aiko", "Bruno", "Chloe", "Diego",
    "Emma", "Felix", "Gina", "Hugo", "Ivy", "Jonas", "Kira", "Liam", "Maya", "Nils",
]  # fmt: skip
ITEMS = [
    ("apple", "apples"), ("book", "books"), ("pencil", "pencils"), ("marble", "marbles"),
    ("cookie", "cookies"), ("sticker", "stickers"), ("shell", "shells"), ("card", "cards"),
    ("cupcake", "cupcakes"), ("orange", "oranges"), ("toy car", "toy cars"), ("egg", "eggs"),
    ("flower", "flowers"), ("ribbon", "ribbons"), ("stamp", "stamps"), ("muffin", "muffins"),
    ("notebook", "notebooks"), ("balloon", "balloons"), ("candle", "candles"), ("brick", "bricks"),
]  # fmt: skip
CONTAINERS = [("box", "boxes"), ("bag", "bags"), ("basket", "baskets"), ("crate", "crates"),
              ("jar", "jars"), ("tray", "trays"), ("shelf", "shelves"), ("pack", "packs")]  # fmt: skip
PLACES = ["market", "bakery", "library", "school fair", "garden", "farm", "shop", "park"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
UNITS_TIME = [("minute", "minutes"), ("hour", "hours"), ("day", "days"), ("week", "weeks")]
ADJECTIVES = ["red", "blue", "green", "small", "large", "old", "new", "shiny", "striped"]
VERBS_GIVE = ["gives", "hands", "passes", "lends", "sends"]


def _words(text: str) -> list[str]:
    return text.split()


# A broader everyday vocabulary for the plain-text documents, so the BPE learns
# whole-word tokens beyond the word-problem templates.
ANIMALS = _words("""ant bear bee beetle bird camel cat cow crab crow deer dog dolphin donkey duck eagle
elephant falcon ferret fish fox frog goat goose hamster hedgehog heron horse kangaroo koala lamb
lion lizard llama mole monkey moose mouse octopus otter owl panda parrot penguin pig pigeon pony
rabbit raccoon rat robin salmon seal shark sheep snail snake sparrow spider squirrel swan tiger
toad trout turkey turtle whale wolf zebra""")
FOODS = _words("""apricot bagel banana bean berry biscuit bread broccoli butter cabbage cake carrot cereal
cheese cherry chicken chocolate coconut corn cracker cream cucumber curry dumpling garlic grape
honey jam lemon lentil lettuce mango melon milk mushroom noodle oat olive onion pancake pasta
peach peanut pear pepper pie pizza plum potato pumpkin raisin rice salad sandwich sausage soup
spinach strawberry sugar tea toast tomato waffle walnut yogurt""")
JOBS = _words("""baker builder carpenter cashier chef clerk coach dentist doctor driver electrician engineer
farmer firefighter florist gardener guide janitor journalist judge lawyer librarian mechanic
musician nurse painter pharmacist photographer pilot plumber poet police officer potter
programmer sailor scientist singer soldier student surgeon tailor teacher technician waiter
writer""")
PLACES_MORE = _words("""airport aquarium bank beach bridge cafe castle cinema city clinic college
countryside desert factory forest gallery garage harbor hospital hotel island kitchen lake
meadow mountain museum neighborhood office orchard palace playground pond post river road
stadium station street studio supermarket swimming pool theater tower town valley village
warehouse workshop zoo""")
VERBS = _words("""admired answered arrived asked baked borrowed bought brought built called carried
caught changed chose cleaned climbed closed collected cooked counted covered crossed danced
decided delivered designed discovered drew drove explained filled fixed folded followed forgot
found gathered grew guessed helped hid hoped hurried imagined invited joined jumped kept kicked
knocked laughed learned left lifted listened lost measured mixed moved named noticed opened
ordered painted planned planted played poured practiced prepared printed promised pulled
pushed raced reached read remembered repaired returned rode sailed saved searched shared
shouted showed sang sorted spent started stayed stopped studied swam talked taught thanked
threw tied touched traveled tried turned visited waited walked washed watched whispered won
wondered worked wrapped wrote""")
ADVERBS = _words("""almost already always carefully certainly clearly closely easily eventually exactly
finally gently happily honestly immediately luckily nearly never often only perhaps politely
quickly quietly rarely really recently sadly seldom slowly soon suddenly surely together
usually""")
ADJ_MORE = _words("""afraid ancient angry bright brave busy calm cheap clean clever cloudy cold
comfortable crowded curious dark deep delicious dirty dry early easy empty enormous exciting
famous fast favorite fresh friendly full funny gentle giant golden heavy helpful honest hungry
important kind late lazy light little loud lucky modern narrow nervous noisy polite popular
proud quiet rainy rare ready rich rough round salty sharp short silent simple sleepy smooth
soft sour special spicy steep strange strong sunny sweet tall tidy tiny tired warm wet wide
wild windy wise wooden young""")
THINGS = _words("""backpack bicycle blanket bottle bucket button calendar camera candle carpet chair
clock coat computer cup desk dictionary door drawer envelope feather fence flag glove guitar
hammer hat helmet jacket kettle key kite ladder lamp letter map mirror needle newspaper pillow
piano plate pocket puzzle radio rope ruler saucepan scarf scissors shoe spoon suitcase table
telescope ticket towel tractor trumpet umbrella violin wagon wallet watch wheel window""")
TOPICS = _words("""addition subtraction multiplication division fraction decimal percentage average
remainder estimate pattern shape triangle rectangle square circle angle perimeter area volume
length width height distance weight temperature speed money budget profit discount interest
ratio proportion sequence equation variable solution answer question problem example
exercise lesson homework""")
CURRENCY = [("$", ""), ("€", ""), ("", " dollars"), ("", " euros")]


def money(amount: int, cur: tuple[str, str]) -> str:
    return f"{cur[0]}{amount}{cur[1]}"


def possessive(name: str, rng: random.Random) -> str:
    # Mostly ASCII apostrophes, sometimes the typographic one, as real text does.
    return name + ("\u2019s" if rng.random() < 0.25 else "'s")


Solution = tuple[str, list[str], int]  # question, solution steps, final answer


def wp_buy(rng: random.Random, calc: bool) -> Solution:
    name = rng.choice(NAMES)
    one, many = rng.choice(ITEMS)
    n, price = rng.randint(2, 15), rng.randint(2, 20)
    cur = rng.choice(CURRENCY)
    total = n * price
    q = f"{name} buys {n} {many} at the {rng.choice(PLACES)}. Each {one} costs {money(price, cur)}. How much does {name} spend?"
    c = f"<<{n}*{price}={total}>>" if calc else ""
    steps = [
        f"Each {one} costs {money(price, cur)}, so {n} {many} cost {n} * {price} = {c}{money(total, cur)}."
    ]
    return q, steps, total


def wp_buy_change(rng: random.Random, calc: bool) -> Solution:
    name = rng.choice(NAMES)
    _, many = rng.choice(ITEMS)
    n, price = rng.randint(2, 9), rng.randint(2, 12)
    cost = n * price
    paid = (cost // 10 + 1 + rng.randint(0, 3)) * 10
    cur = rng.choice(CURRENCY)
    q = f"{name} buys {n} {many} for {money(price, cur)} each and pays with {money(paid, cur)}. How much change does {name} get back?"
    c1 = f"<<{n}*{price}={cost}>>" if calc else ""
    c2 = f"<<{paid}-{cost}={paid - cost}>>" if calc else ""
    steps = [
        f"The {many} cost {n} * {price} = {c1}{money(cost, cur)} in total.",
        f"The change is {paid} - {cost} = {c2}{money(paid - cost, cur)}.",
    ]
    return q, steps, paid - cost


def wp_give_away(rng: random.Random, calc: bool) -> Solution:
    a, b = rng.sample(NAMES, 2)
    _, many = rng.choice(ITEMS)
    start = rng.randint(20, 120)
    give = rng.randint(1, start // 2)
    more = rng.randint(1, 40)
    left = start - give
    end = left + more
    q = (f"{a} has {start} {many}. {a} {rng.choice(VERBS_GIVE)} {give} of them to {b} and then "
         f"finds {more} more. How many {many} does {a} have now?")  # fmt: skip
    c1 = f"<<{start}-{give}={left}>>" if calc else ""
    c2 = f"<<{left}+{more}={end}>>" if calc else ""
    steps = [
        f"After giving some away, {a} has {start} - {give} = {c1}{left} {many}.",
        f"After finding more, {a} has {left} + {more} = {c2}{end} {many}.",
    ]
    return q, steps, end


def wp_containers(rng: random.Random, calc: bool) -> Solution:
    name = rng.choice(NAMES)
    _, many = rng.choice(ITEMS)
    cone, cmany = rng.choice(CONTAINERS)
    k, per, extra = rng.randint(2, 12), rng.randint(3, 25), rng.randint(0, 15)
    inside = k * per
    total = inside + extra
    q = (f"{name} packs {many} into {k} {cmany}. Each {cone} holds {per} {many}, and {extra} "
         f"{many} are left over. How many {many} does {name} have?")  # fmt: skip
    c1 = f"<<{k}*{per}={inside}>>" if calc else ""
    c2 = f"<<{inside}+{extra}={total}>>" if calc else ""
    steps = [
        f"The {cmany} hold {k} * {per} = {c1}{inside} {many}.",
        f"With the leftovers there are {inside} + {extra} = {c2}{total} {many}.",
    ]
    return q, steps, total


def wp_share(rng: random.Random, calc: bool) -> Solution:
    name = rng.choice(NAMES)
    _, many = rng.choice(ITEMS)
    friends = rng.randint(2, 9)
    each = rng.randint(2, 20)
    kept = rng.randint(0, 10)
    shared = friends * each
    total = shared + kept
    q = (f"{name} shares {shared} {many} equally among {friends} friends and keeps {kept} for "
         f"{'herself' if rng.random() < 0.5 else 'himself'}. How many {many} does each friend get?")  # fmt: skip
    c = f"<<{shared}/{friends}={each}>>" if calc else ""
    steps = [f"Each friend gets {shared} / {friends} = {c}{each} {many}."]
    if rng.random() < 0.3:
        steps.append(
            f"({name} started with {shared} + {kept} = {total} {many}, but that is not asked.)"
        )
    return q, steps, each


def wp_speed(rng: random.Random, calc: bool) -> Solution:
    name = rng.choice(NAMES)
    speed, hours = rng.randint(3, 60), rng.randint(2, 9)
    back = rng.randint(1, hours)
    d1 = speed * hours
    d2 = speed * back
    total = d1 + d2
    q = (f"{name} travels at {speed} km per hour for {hours} hours on {rng.choice(DAYS)}, "
         f"then travels {back} more {'hour' if back == 1 else 'hours'} at the same speed. How many kilometers does {name} travel in all?")  # fmt: skip
    c1 = f"<<{speed}*{hours}={d1}>>" if calc else ""
    c2 = f"<<{speed}*{back}={d2}>>" if calc else ""
    c3 = f"<<{d1}+{d2}={total}>>" if calc else ""
    steps = [
        f"First {name} travels {speed} * {hours} = {c1}{d1} km.",
        f"Then {name} travels {speed} * {back} = {c2}{d2} km.",
        f"In all that is {d1} + {d2} = {c3}{total} km.",
    ]
    return q, steps, total


def wp_wage(rng: random.Random, calc: bool) -> Solution:
    name = rng.choice(NAMES)
    rate, hours, days = rng.randint(8, 30), rng.randint(2, 8), rng.randint(2, 6)
    cur = rng.choice(CURRENCY)
    per_day = rate * hours
    total = per_day * days
    q = (f"{name} earns {money(rate, cur)} an hour at the {rng.choice(PLACES)}. {name} works {hours} hours "
         f"a day for {days} days. How much does {name} earn?")  # fmt: skip
    c1 = f"<<{rate}*{hours}={per_day}>>" if calc else ""
    c2 = f"<<{per_day}*{days}={total}>>" if calc else ""
    steps = [
        f"In one day {name} earns {rate} * {hours} = {c1}{money(per_day, cur)}.",
        f"In {days} days {name} earns {per_day} * {days} = {c2}{money(total, cur)}.",
    ]
    return q, steps, total


def wp_half_double(rng: random.Random, calc: bool) -> Solution:
    a, b = rng.sample(NAMES, 2)
    _, many = rng.choice(ITEMS)
    x = rng.randint(2, 60) * 2
    half = x // 2
    total = x + half
    q = (f"{a} collected {x} {many} in April. In May {a} collected half as many as in April. "
         f"How many {many} did {a} collect in April and May together?")  # fmt: skip
    if rng.random() < 0.3:
        q = q.replace(f"{a} collected {x}", f"{possessive(b, rng)} friend {a} collected {x}", 1)
    c1 = f"<<{x}/2={half}>>" if calc else ""
    c2 = f"<<{x}+{half}={total}>>" if calc else ""
    steps = [
        f"In May {a} collected {x} / 2 = {c1}{half} {many}.",
        f"Together that is {x} + {half} = {c2}{total} {many}.",
    ]
    return q, steps, total


def wp_percent(rng: random.Random, calc: bool) -> Solution:
    name = rng.choice(NAMES)
    one, _ = rng.choice(ITEMS)
    pct = rng.choice([10, 20, 25, 50])
    price = rng.randint(2, 40) * (100 // pct)
    cur = rng.choice(CURRENCY)
    off = price * pct // 100
    final = price - off
    q = f"A {rng.choice(ADJECTIVES)} {one} costs {money(price, cur)}. It is on sale for {pct}% off. How much does {name} pay for it?"
    c1 = f"<<{price}*{pct}/100={off}>>" if calc else ""
    c2 = f"<<{price}-{off}={final}>>" if calc else ""
    steps = [
        f"The discount is {price} * {pct} / 100 = {c1}{money(off, cur)}.",
        f"{name} pays {price} - {off} = {c2}{money(final, cur)}.",
    ]
    return q, steps, final


def wp_time(rng: random.Random, calc: bool) -> Solution:
    name = rng.choice(NAMES)
    one, many = rng.choice(UNITS_TIME[:2])
    per, tasks, rest = rng.randint(3, 30), rng.randint(2, 8), rng.randint(5, 30)
    work = per * tasks
    total = work + rest
    q = (f"It takes {name} {per} {many} to finish one puzzle. {name} finishes {tasks} puzzles and "
         f"then rests for {rest} {many}. How many {many} pass in total?")  # fmt: skip
    del one
    c1 = f"<<{per}*{tasks}={work}>>" if calc else ""
    c2 = f"<<{work}+{rest}={total}>>" if calc else ""
    steps = [
        f"The puzzles take {per} * {tasks} = {c1}{work} {many}.",
        f"Adding the rest gives {work} + {rest} = {c2}{total} {many}.",
    ]
    return q, steps, total


def wp_temperature(rng: random.Random, calc: bool) -> Solution:
    start, rise, fall = rng.randint(-5, 20), rng.randint(1, 15), rng.randint(1, 10)
    mid = start + rise
    end = mid - fall
    q = (f"At 8 a.m. the temperature was {start}°C. By noon it rose {rise}°C, and by evening it "
         f"fell {fall}°C. What was the temperature in the evening?")  # fmt: skip
    c1 = f"<<{start}+{rise}={mid}>>" if calc else ""
    c2 = f"<<{mid}-{fall}={end}>>" if calc else ""
    steps = [
        f"At noon it was {start} + {rise} = {c1}{mid}°C.",
        f"In the evening it was {mid} - {fall} = {c2}{end}°C.",
    ]
    return q, steps, end


def story(rng: random.Random) -> str:
    """A few loosely connected sentences over the broader vocabulary."""
    a, b = rng.sample(NAMES, 2)
    job, animal, food = rng.choice(JOBS), rng.choice(ANIMALS), rng.choice(FOODS)
    place, thing, topic = rng.choice(PLACES_MORE), rng.choice(THINGS), rng.choice(TOPICS)
    verb, verb2 = rng.sample(VERBS, 2)
    adv, adj, adj2 = rng.choice(ADVERBS), rng.choice(ADJ_MORE), rng.choice(ADJ_MORE)
    sentences = [
        f"{a} is a {adj} {job} who lives near the {place}.",
        f"One {adj2} morning, {a} {adv} {verb} a {thing} and {verb2} it to {b}.",
        f"A {animal} watched them from behind the {rng.choice(THINGS)}.",
        f"For lunch they had {food} with {rng.choice(FOODS)} and a cup of tea.",
        f"Later, {b} practiced {topic} for {rng.randint(10, 90)} minutes.",
        f"The {rng.choice(ANIMALS)} at the {rng.choice(PLACES_MORE)} was {rng.choice(ADJ_MORE)} and {rng.choice(ADJ_MORE)}.",
        f"{possessive(b, rng)} {rng.choice(THINGS)} was {rng.choice(ADJ_MORE)}, so {b} {rng.choice(VERBS)} it.",
        f"Every {job} knows that {topic} is {rng.choice(ADJ_MORE)} when you work {rng.choice(ADVERBS)}.",
    ]
    rng.shuffle(sentences)
    return " ".join(sentences[: rng.randint(3, 6)])


def wp_legs(rng: random.Random, calc: bool) -> Solution:
    birds = rng.choice(["chickens", "ducks", "geese", "turkeys"])
    beasts = rng.choice(["cows", "goats", "pigs", "sheep", "horses", "donkeys"])
    b, q4 = rng.randint(2, 30), rng.randint(2, 30)
    lb, lq = 2 * b, 4 * q4
    place = rng.choice(["farm", "zoo", "meadow", "village"])
    q = f"A {place} has {b} {birds} and {q4} {beasts}. How many legs do the animals have in total?"
    c1 = f"<<{b}*2={lb}>>" if calc else ""
    c2 = f"<<{q4}*4={lq}>>" if calc else ""
    c3 = f"<<{lb}+{lq}={lb + lq}>>" if calc else ""
    steps = [
        f"The {birds} have {b} * 2 = {c1}{lb} legs.",
        f"The {beasts} have {q4} * 4 = {c2}{lq} legs.",
        f"In total there are {lb} + {lq} = {c3}{lb + lq} legs.",
    ]
    return q, steps, lb + lq


def wp_reading(rng: random.Random, calc: bool) -> Solution:
    name = rng.choice(NAMES)
    per_day, days = rng.randint(5, 40), rng.randint(2, 14)
    read = per_day * days
    total = read + rng.randint(10, 200)
    left = total - read
    q = (f"{name} is reading a book about {rng.choice(TOPICS)} that has {total} pages. {name} reads "
         f"{per_day} pages every day for {days} days. How many pages are left?")  # fmt: skip
    c1 = f"<<{per_day}*{days}={read}>>" if calc else ""
    c2 = f"<<{total}-{read}={left}>>" if calc else ""
    steps = [
        f"{name} has read {per_day} * {days} = {c1}{read} pages.",
        f"There are {total} - {read} = {c2}{left} pages left.",
    ]
    return q, steps, left


def wp_recipe(rng: random.Random, calc: bool) -> Solution:
    name, job = rng.choice(NAMES), rng.choice(["baker", "chef", "cook"])
    food = rng.choice(["pancakes", "muffins", "cookies", "dumplings", "waffles", "biscuits"])
    cups, batches = rng.randint(2, 6), rng.randint(2, 9)
    total = cups * batches
    q = (f"{name} the {job} needs {cups} cups of flour for one batch of {food}. How many cups of "
         f"flour does {name} need for {batches} batches?")  # fmt: skip
    c = f"<<{cups}*{batches}={total}>>" if calc else ""
    return q, [f"{name} needs {cups} * {batches} = {c}{total} cups of flour."], total


WORD_PROBLEMS: list[Callable[[random.Random, bool], Solution]] = [
    wp_buy, wp_buy_change, wp_give_away, wp_containers, wp_share, wp_speed, wp_wage,
    wp_half_double, wp_percent, wp_time, wp_temperature, wp_legs, wp_reading, wp_recipe,
]  # fmt: skip


def arithmetic(rng: random.Random) -> Solution:
    kind = rng.random()
    if kind < 0.45:
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice(["+", "-", "*"])
        if op == "*":
            a, b = rng.randint(0, 99), rng.randint(0, 99)
        r = a + b if op == "+" else a - b if op == "-" else a * b
        q = rng.choice([f"What is {a} {op} {b}?", f"Compute {a} {op} {b}.", f"{a} {op} {b} = ?"])
        return q, [f"{a} {op} {b} = {r}"], r
    if kind < 0.6:
        b, r = rng.randint(1, 30), rng.randint(0, 50)
        a = b * r
        return f"What is {a} / {b}?", [f"{a} / {b} = {r}"], r
    a, b, c = rng.randint(1, 99), rng.randint(1, 99), rng.randint(2, 12)
    s = a + b
    q = f"Compute ({a} + {b}) * {c}."
    steps = [f"First, {a} + {b} = {s}.", f"Then, {s} * {c} = {s * c}."]
    return q, steps, s * c


def plain_text(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    one, many = rng.choice(ITEMS)
    cone, _ = rng.choice(CONTAINERS)
    sentences = [
        f"{a} walked to the {rng.choice(PLACES)} on {rng.choice(DAYS)} morning.",
        f"The {rng.choice(ADJECTIVES)} {cone} was full of {many}; {b} counted them twice.",
        f"“Can I borrow a {one}?” asked {b}. “Of course,” said {a}.",
        f"{possessive(a, rng)} {one} isn't {rng.choice(ADJECTIVES)}, it's {rng.choice(ADJECTIVES)}!",
        f"Prices rose by {rng.randint(1, 9)}% this year — a {one} now costs €{rng.randint(1, 9)},{rng.randint(10, 99)}.",
        "Remember: check every step, then write the answer after ####.",
        f"{b} doesn't like {many}, but {a} does.",
        f"In {rng.randint(1990, 2030)}, the {rng.choice(PLACES)} opened at {rng.randint(6, 11)}:{rng.choice(['00', '15', '30', '45'])} a.m.",
    ]
    rng.shuffle(sentences)
    return " ".join(sentences[: rng.randint(2, 5)])


def render_solution(steps: list[str], answer: int) -> str:
    return "\n".join([*steps, f"#### {answer}"])


def chat(rng: random.Random, question: str, solution: str) -> str:
    turns = []
    if rng.random() < 0.6:
        turns.append(f"<|im_start|>system\n{rng.choice(SYSTEMS)}<|im_end|>")
    user = f"{question} {INSTRUCTION}" if rng.random() < 0.7 else question
    turns.append(f"<|im_start|>user\n{user}<|im_end|>")
    turns.append(f"<|im_start|>assistant\n{solution}<|im_end|>")
    return "\n".join(turns)


def document(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.08:
        return plain_text(rng)
    if r < 0.2:
        return story(rng)
    if r < 0.35:
        q, steps, ans = arithmetic(rng)
    else:
        q, steps, ans = rng.choice(WORD_PROBLEMS)(rng, rng.random() < 0.5)
    solution = render_solution(steps, ans)
    if rng.random() < 0.35:
        return chat(rng, q, solution)
    return f"Question: {q}\nAnswer: {solution}"


def generate(seed: int = SEED, target_bytes: int = TARGET_BYTES) -> str:
    rng = random.Random(seed)
    docs: list[str] = []
    size = 0
    while size < target_bytes:
        doc = document(rng)
        docs.append(doc)
        size += len(doc.encode()) + 2
    return "\n\n".join(docs) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--check", action="store_true", help="fail if --out differs")
    args = parser.parse_args()
    text = generate()
    if args.check:
        same = args.out.exists() and args.out.read_text(encoding="utf-8") == text
        print("corpus up to date" if same else f"corpus differs: {args.out}")
        return 0 if same else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out} ({len(text.encode())} bytes, {text.count(chr(10) * 2) + 1} documents)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
