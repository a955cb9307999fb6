"""Generate elements.md, the table trace's source text (facts only; this file and its output are CC0).

Columns: atomic number, symbol, name, standard atomic weight (rounded to 3 decimals; the mass
number of the most stable isotope in brackets for elements without a standard weight), period,
group and category, for elements 1-40.
"""
ROWS = [
    (1, "H", "Hydrogen", "1.008", 1, 1, "nonmetal"),
    (2, "He", "Helium", "4.003", 1, 18, "noble gas"),
    (3, "Li", "Lithium", "6.94", 2, 1, "alkali metal"),
    (4, "Be", "Beryllium", "9.012", 2, 2, "alkaline earth metal"),
    (5, "B", "Boron", "10.81", 2, 13, "metalloid"),
    (6, "C", "Carbon", "12.011", 2, 14, "nonmetal"),
    (7, "N", "Nitrogen", "14.007", 2, 15, "nonmetal"),
    (8, "O", "Oxygen", "15.999", 2, 16, "nonmetal"),
    (9, "F", "Fluorine", "18.998", 2, 17, "halogen"),
    (10, "Ne", "Neon", "20.180", 2, 18, "noble gas"),
    (11, "Na", "Sodium", "22.990", 3, 1, "alkali metal"),
    (12, "Mg", "Magnesium", "24.305", 3, 2, "alkaline earth metal"),
    (13, "Al", "Aluminium", "26.982", 3, 13, "post-transition metal"),
    (14, "Si", "Silicon", "28.085", 3, 14, "metalloid"),
    (15, "P", "Phosphorus", "30.974", 3, 15, "nonmetal"),
    (16, "S", "Sulfur", "32.06", 3, 16, "nonmetal"),
    (17, "Cl", "Chlorine", "35.45", 3, 17, "halogen"),
    (18, "Ar", "Argon", "39.95", 3, 18, "noble gas"),
    (19, "K", "Potassium", "39.098", 4, 1, "alkali metal"),
    (20, "Ca", "Calcium", "40.078", 4, 2, "alkaline earth metal"),
    (21, "Sc", "Scandium", "44.956", 4, 3, "transition metal"),
    (22, "Ti", "Titanium", "47.867", 4, 4, "transition metal"),
    (23, "V", "Vanadium", "50.942", 4, 5, "transition metal"),
    (24, "Cr", "Chromium", "51.996", 4, 6, "transition metal"),
    (25, "Mn", "Manganese", "54.938", 4, 7, "transition metal"),
    (26, "Fe", "Iron", "55.845", 4, 8, "transition metal"),
    (27, "Co", "Cobalt", "58.933", 4, 9, "transition metal"),
    (28, "Ni", "Nickel", "58.693", 4, 10, "transition metal"),
    (29, "Cu", "Copper", "63.546", 4, 11, "transition metal"),
    (30, "Zn", "Zinc", "65.38", 4, 12, "transition metal"),
    (31, "Ga", "Gallium", "69.723", 4, 13, "post-transition metal"),
    (32, "Ge", "Germanium", "72.630", 4, 14, "metalloid"),
    (33, "As", "Arsenic", "74.922", 4, 15, "metalloid"),
    (34, "Se", "Selenium", "78.971", 4, 16, "nonmetal"),
    (35, "Br", "Bromine", "79.904", 4, 17, "halogen"),
    (36, "Kr", "Krypton", "83.798", 4, 18, "noble gas"),
    (37, "Rb", "Rubidium", "85.468", 5, 1, "alkali metal"),
    (38, "Sr", "Strontium", "87.62", 5, 2, "alkaline earth metal"),
    (39, "Y", "Yttrium", "88.906", 5, 3, "transition metal"),
    (40, "Zr", "Zirconium", "91.224", 5, 4, "transition metal"),
]


def main():
    lines = ["# The first forty chemical elements", "",
             "| Z | Symbol | Name | Atomic weight | Period | Group | Category |",
             "|---|--------|------|---------------|--------|-------|----------|"]
    lines += [f"| {z} | {s} | {n} | {w} | {p} | {g} | {c} |" for z, s, n, w, p, g, c in ROWS]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import pathlib
    pathlib.Path(__file__).with_name("elements.md").write_text(main(), encoding="utf-8")
