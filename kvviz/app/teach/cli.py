"""`kvviz lesson list | check FILE`: the lessons a page can open, and one checked whole."""
from __future__ import annotations

import sys


def parser(sub) -> None:
    p = sub.add_parser("lesson", help="lessons for a class: kvviz lesson list | check FILE")
    cmds = p.add_subparsers(dest="lesson_command", required=True)
    ls = cmds.add_parser("list", help="the lessons in lessons/ (name, scenes, minutes, title)")
    ls.set_defaults(func=run, parser=ls)
    ck = cmds.add_parser("check", help="validate a lesson, compute every speaker note and check "
                         "that every question a scene offers is decided by clear evidence and that no scene "
                         "calls a secondary result primary or claims forgetting it does not show: "
                         "one line per scene, or one error line and exit 2")
    ck.add_argument("file", help="a lesson file (lessons/NAME.toml) or a lesson name")
    ck.set_defaults(func=run, parser=ck)


def run(args) -> int:
    from kvviz.app.teach import lesson as L

    try:
        if args.lesson_command == "list":
            names = L.names()
            if not names:
                print(f"no lessons in {L.lessons_folder()}")
            for name in names:
                try:
                    les = L.load(name)
                    print(f"{name} · {len(les.scenes)} scenes · {les.minutes:g} min · {les.title}")
                except ValueError as exc:
                    print(f"{name} · invalid: {exc}")
            return 0
        les = L.load(args.file)
        for s in les.scenes:
            L.note_text(les, s.number)  # every placeholder computed, or the error
            print(L.summary(les, s.number))
        L.check_evidence(les)  # every question the scenes offer decided by clear evidence
        L.check_claims(les)  # no secondary result called primary; "forgets" shown where it can be
        print(f"{les.path.name}: {les.title}, {len(les.scenes)} scenes, {les.minutes:g} min: ok")
        return 0
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
