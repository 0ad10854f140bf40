"""The math grader against the reference grader's semantics (math-verify 0.9.0), by answer class: each class has
right answers that must be paid and wrong answers that must not be, graded through the row's data source as
training grades them.

Rows marked ``main`` were graded the other way by the grader before issue 40 (``issue 55``: before issue 55) (a
right answer refused, or a wrong one paid); rows marked ``ours`` are where we part from the reference on purpose,
each because the reference pays a wrong answer or refuses a right one for a reason of form. Rows marked ``sweep``
come from other graders' cases and conventions (lm-evaluation-harness's MATH and Minerva graders, prm800k's,
Qwen2.5-Math's, verl's, hendrycks/math's tests); with ``main`` they were graded the other way before that sweep.
"""

import pytest

from megaopd.data.rows import Row
from megaopd.verifiers import score, verifier_errors

# (class, data source, response, reference answer, grade, extra_info)
CASES = [
    # --- where the answer is read
    ("extraction", "math", r"So the area is $\boxed{\frac{1}{2}}$ square units.", "0.5", 1, {}),
    ("extraction", "math", r"so the answer is \fbox{7}", "7", 1, {}),  # ours: the reference reads no \fbox
    ("extraction", "math", "Final Answer: The final answer is 7.78. I hope it is correct.", "7.78", 1, {}),  # main
    ("extraction", "math", r"First \boxed{3}, then \boxed{5}. Checking again: Final Answer: The final answer is "
                           r"$4$. I hope it is correct.", "4", 1, {}),  # main: the last box won
    ("extraction", "math", r"First \boxed{3}, then \boxed{5}. Checking again: Final Answer: The final answer is "
                           r"$4$. I hope it is correct.", "5", 0, {}),  # main paid the last box
    ("extraction", "math", r"The final answer is \sqrt{2}. I hope it is correct.", r"\frac{2}{\sqrt{2}}", 1, {}),  # main; ours
    ("extraction", "math", r"So the final answer is \frac{\pi}{4}", r"\dfrac{\pi}{4}", 1, {}),  # ours: no delimiters
    ("extraction", "math", r"Answer: \sqrt{3}", r"\sqrt{2}", 0, {}),
    ("extraction", "math", "She buys 3 packs of 4, so the answer is 12 apples in all.", "12", 1, {}),  # main
    ("extraction", "math", r"We have $x = 2$, so $y = \frac{10}{9}$", r"\frac{10}{9}", 1, {}),  # main: read 9
    ("extraction", "math", r"\frac{10}{9}", "10/9", 1, {}),  # main: read 9
    ("extraction", "math", r"x = \frac{1+\sqrt{5}}{2}", "2", 0, {}),  # main paid its last digit
    ("extraction", "math", "AZYUK2A", "2", 0, {}),  # main paid
    ("extraction", "math", "11 7/6", "7/6", 0, {}),  # main paid
    ("extraction", "math", "Answer $ \n 9 \n $", "9", 0, {}),  # main; ours: no number inside LaTeX, even broken
    ("extraction", "openai/gsm8k", "**Answer: 18**", "18", 1, {}),  # sweep: lm-eval gsm8k; main read 18** as arithmetic
    ("extraction", "math", "The answer is **18**.", "18", 1, {}),  # sweep: lm-eval gsm8k
    ("extraction", "math", "**The final answer is 18**", "18", 1, {}),  # sweep
    ("extraction", "math", "**Answer: 2/3**", r"\frac{2}{3}", 1, {}),  # sweep; main read 2/3**
    ("extraction", "openai/gsm8k", "**Answer: 19**", "18", 0, {}),
    ("extraction", "math", "She has 72 clips left.", "72", 1, {}),
    ("extraction", "openai/gsm8k", "Natalia sold 48/2 = 24 clips in May.\n#### 72", "72", 1, {}),
    ("extraction", "openai/gsm8k", r"Natalia sold $\boxed{72}$ clips.", "72", 1, {}),
    ("extraction", "openai/gsm8k", "She has 72 clips left.", "72", 0, {}),  # main paid: strict wants a mark
    ("extraction", "openai/gsm8k", "She has 72 clips left.", "72", 1, {"extraction": "flexible"}),
    ("extraction", "math", "She has 72 clips left.", "72", 0, {"extraction": "strict"}),  # main
    # --- a number with a power, subscript or LaTeX command written on it is the start of an expression, no number
    ("glued", "math", r"The answer is 2\sqrt{3}.", "2", 0, {}),  # sweep: Qwen2.5-Math parser (answer line); main paid
    ("glued", "math", r"The final answer is 2\sqrt{3}", "2", 0, {}),  # sweep; main paid
    ("glued", "math", r"So x = 2^{10}", "2", 0, {}),  # sweep; main paid
    ("glued", "math", r"The answer is 3\frac{1}{2}.", r"\frac{1}{2}", 0, {}),  # sweep; main paid
    ("glued", "math", r"The answer is 2\sqrt{3}.", r"2\sqrt{3}", 1, {}),  # sweep: Qwen2.5-Math parser; main read 2
    ("glued", "math", r"The answer is 2\pi.", r"2\pi", 1, {}),  # sweep; main read 2
    ("glued", "math", r"The answer is 3\frac{1}{2}.", r"\frac{7}{2}", 1, {}),  # sweep; main read 1/2
    ("glued", "math", r"So the answer is 2^{10}", "1024", 1, {}),  # sweep; main: no answer
    ("glued", "math", r"The answer is 3 \times 5.", "3", 0, {}),  # sweep: hendrycks_math strictness; main paid
    ("glued", "math", r"The answer is x + 5.", "5", 0, {}),  # sweep; main paid: an operand is no answer
    ("glued", "math", r"We get y = x + 5", "5", 0, {}),  # sweep; main paid
    ("glued", "math", r"The answer is 3 \times 5.", "15", 1, {}),  # sweep; main read 3
    ("glued", "math", r"The answer is 2 \cdot 3.", "6", 1, {}),  # sweep; main read 2
    ("glued", "math", "Answer: 2 + 3 = 5", "5", 1, {}),
    ("glued", "math", "Answer: 2x+1", "2", 0, {}),  # sweep: prm800k strictness; main paid a coefficient
    ("glued", "math", "The answer is 3x^2 - 1.", "3", 0, {}),  # sweep; main paid
    ("glued", "math", "The answer is 12cm.", "12", 1, {}),
    ("glued", "math", "The area is 1,000.99m².", "1000.99", 1, {}),  # Math-Verify tests/test_all.py
    ("glued", "math", r"The angle is 30^\circ.", "30", 1, {}),
    ("glued", "math", r"The answer is 12\text{ cm}.", "12", 1, {}),
    # --- what boxes mean: read together, and an empty box among them is no answer (the reference's reading)
    ("boxes", "math", r"\boxed{42} and finally \boxed{}", "42", 0, {}),  # issue 55: main paid
    ("boxes", "math", r"So \boxed{} and then \boxed{7}", "7", 0, {}),  # issue 55
    ("boxes", "math", r"\boxed{}", "0", 0, {}),
    ("boxes", "math", r"It is \boxed{42}. Done.", "42", 1, {}),
    ("boxes", "math", r"The roots are \boxed{2} and \boxed{3}", "$2, 3$", 1, {}),
    ("boxes", "math", r"\boxed{}. The final answer is 9. I hope it is correct.", "9", 1, {}),
    # --- numbers: separators, decimal commas, currency
    ("numbers", "math", "1 000", "1000", 1, {}),  # main
    ("numbers", "math", "The total is 7,425,000.", "7425000", 1, {}),
    ("numbers", "math", "1000,99", "1000.99", 1, {}),  # main
    ("numbers", "math", "Soucis : 2,74 $ a..", "2.74", 1, {}),  # main
    ("numbers", "math", "the number is not 10 which is 1,000.99€", "1000.99", 1, {}),
    ("numbers", "math", r"It costs $\boxed{\$16,\!386.20}$.", "16386.2", 1, {}),
    ("numbers", "math", r"\boxed{1\,000}", "1000", 1, {}),  # ours: the reference reads 1\,000 as 1*0
    ("numbers", "math", r"\boxed{1\,000}", "0", 0, {}),  # ours: the reference pays it
    ("numbers", "math", r"\boxed{2 3}", "5", 0, {}),  # ours: the reference reads 2 3 as 5
    ("numbers", "math", "The total is 1,001.", "1000", 0, {}),
    ("numbers", "math", r"\boxed{-5}", "5", 0, {}),
    ("numbers", "math", "1.22", "1,22", 1, {}),  # issue 55: a reference's decimal comma, as the reference reads it
    ("numbers", "math", "The answer is -0.5", "-0,5", 1, {}),  # issue 55
    ("numbers", "math", "1.225", "1,225", 0, {}),  # a comma before three digits groups thousands
    ("numbers", "math", "122", "1,22", 0, {}),
    ("numbers", "math", r"\boxed{1,22}", "1.22", 0, {}),  # inside a box a comma separates two answers
    # a bare reference "1,2" reads two ways, both paid: a decimal comma (the reference's reading) and a pair
    ("numbers", "math", r"\boxed{1,2}", "1,2", 1, {}),  # sweep: hendrycks_math, prm800k; main; ours: reference refuses
    ("numbers", "math", r"\boxed{-1, 2}", "-1,2", 1, {}),  # sweep: lm-eval hendrycks_math, prm800k; main refused
    ("numbers", "math", "The solutions are $2$ and $3$.", "2,3", 1, {}),  # sweep; main refused
    ("numbers", "math", r"\boxed{2, 4}", "2,3", 0, {}),
    # --- currency in the reference: MATH writes an escaped dollar, a currency sign and no LaTeX delimiter
    ("currency", "math", r"\boxed{32348}", r"\$32,\!348", 1, {}),  # sweep: lm-eval hendrycks_math; main refused
    ("currency", "math", r"The total is $\$32,\!348$.", r"\$32,\!348", 1, {}),  # sweep: lm-eval hendrycks_math; main
    ("currency", "math", r"\boxed{1.5}", r"\$1.50", 1, {}),  # sweep: prm800k grader; main refused
    ("currency", "math", r"It costs $1.50.", r"\$1.50", 1, {}),  # sweep: prm800k grader; main refused
    ("currency", "math", r"\boxed{32,349}", r"\$32,\!348", 0, {}),
    ("currency", "math", r"\boxed{1.05}", r"\$1.50", 0, {}),
    # --- Unicode math: the minus sign, roots, infinity, degrees, vulgar fractions, superscripts
    ("unicode", "math", "The answer is −5.", "-5", 1, {}),  # sweep: verl prime_math (unicode); main read 5
    ("unicode", "math", r"\boxed{3√2}", r"3\sqrt{2}", 1, {}),  # sweep: verl prime_math (unicode); main
    ("unicode", "math", r"\boxed{√(10)}", r"\sqrt{10}", 1, {}),  # sweep; main
    ("unicode", "math", "The answer is √2.", r"\sqrt{2}", 1, {}),  # sweep; main
    ("unicode", "math", r"\boxed{(−∞, 3]}", r"(-\infty, 3]", 1, {}),  # sweep; main
    ("unicode", "math", "The angle is 30°.", "30", 1, {}),  # sweep
    ("unicode", "math", r"\boxed{3½}", r"\frac{7}{2}", 1, {}),  # sweep; main
    ("unicode", "math", r"\boxed{x²+1}", "x^2+1", 1, {}),  # sweep; main
    ("unicode", "math", r"\boxed{10⁻³}", "0.001", 1, {}),  # sweep; main
    ("unicode", "math", r"\boxed{−5}", "5", 0, {}),
    ("unicode", "math", r"\boxed{√2}", r"\sqrt{3}", 0, {}),
    ("unicode", "math", r"\boxed{¾}", r"\frac{1}{4}", 0, {}),
    ("unicode", "math", r"\boxed{x²+1}", "x^3+1", 0, {}),
    # --- scientific notation
    ("scientific", "math", r"\boxed{1.5e3}", "1500", 1, {}),  # sweep: Qwen2.5-Math parse_digits; main; ours
    ("scientific", "math", "The answer is 1.5E-4.", "0.00015", 1, {}),  # sweep: prm800k grader; main; ours
    ("scientific", "math", r"\boxed{1500}", "1.5e3", 1, {}),  # sweep: Qwen2.5-Math parse_digits; main; ours
    ("scientific", "math", r"\boxed{1.5 \times 10^{3}}", "1500", 1, {}),
    ("scientific", "math", r"\boxed{1.5e4}", "1500", 0, {}),
    ("scientific", "math", "The answer is 1.5e3.", "1.5", 0, {}),  # main paid
    # --- scale words: a power of ten, never a unit
    ("scale", "math", r"\boxed{2.5 \text{ million}}", "2500000", 1, {}),  # sweep: prm800k grader; main refused
    ("scale", "math", r"\boxed{2500000}", r"2.5\text{ million}", 1, {}),  # sweep: prm800k grader; main refused
    ("scale", "math", "The answer is 2 million.", "2000000", 1, {}),  # sweep: prm800k grader; main read 2
    ("scale", "math", r"\boxed{2000000}", "2 million", 1, {}),  # sweep: prm800k grader; main refused
    ("scale", "math", r"\boxed{2.5 \text{ million}}", "2.5", 0, {}),  # main paid: the scale read as a unit
    ("scale", "math", r"\boxed{2.5}", r"2.5\text{ million}", 0, {}),  # main paid
    ("scale", "math", "The answer is 2 million.", "2", 0, {}),  # main paid
    # --- percentages
    ("percent", "math", "28 percent", r"$28\%$", 1, {}),
    ("percent", "math", r"$\boxed{28 pct}", r"$28\%$", 1, {}),
    ("percent", "math", "The rate rose by 28 %.", "0.28", 1, {}),  # main: read 28
    ("percent", "math", r"\boxed{28\%}", "0.28", 1, {}),
    ("percent", "math", r"\boxed{28\%}", "28", 1, {}),
    ("percent", "math", r"\boxed{29\%}", r"28\%", 0, {}),
    ("percent", "math", r"\boxed{12.5}", r"12.5\%", 1, {}),  # sweep: math-verify semantics; main refused a decimal
    ("percent", "math", r"\boxed{12.5\%}", "12.5", 1, {}),  # sweep: math-verify semantics; main
    ("percent", "math", r"\boxed{0.125}", r"12.5\%", 1, {}),
    ("percent", "math", r"\boxed{1.25}", r"12.5\%", 0, {}),
    ("percent", "math", r"\boxed{12.6}", r"12.5\%", 0, {}),
    ("percent", "math", "28/100", "$28$", 0, {}),
    ("percent", "math", r"\boxed{\frac{28}{100}}", "28", 0, {}),
    # --- rounding at the stated precision (extra_info["precision"], default 6 decimal places)
    ("precision", "math", r"\boxed{0.333333}", r"\frac{1}{3}", 1, {}),  # main: exact only
    ("precision", "math", r"\boxed{0.3333}", r"\frac{1}{3}", 0, {}),
    ("precision", "math", r"\boxed{0.3333}", r"\frac{1}{3}", 1, {"precision": 4}),  # main: no precision
    ("precision", "math", r"$(0.6,2.6667]$", r"(\frac{3}{5},\frac{8}{3}]", 1, {"precision": 2}),  # main
    ("precision", "math", r"\boxed{0.33}", r"\frac{1}{3}", 0, {"precision": 4}),
    ("precision", "math", r"\boxed{1000.0}", "1000", 1, {}),
    # --- fractions in every LaTeX spelling
    ("fractions", "math", r"The ratio is $\dfrac13$.", "1/3", 1, {}),  # main: read 3
    ("fractions", "math", r"$\tfrac{1}{3}$", "1/3", 1, {}),  # main
    ("fractions", "math", r"$\cfrac{1}{3}$", "1/3", 1, {}),  # main
    ("fractions", "math", r"$\frac3{3}$", "1", 1, {}),  # main: read 3
    ("fractions", "math", r"$ 1/3 $", r"\frac{1}{3}", 1, {}),
    ("fractions", "math", r"$-\frac{10}{9}$", "-10/9", 1, {}),  # main: read 9
    ("fractions", "math", r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1, {}),
    ("fractions", "math", r"\boxed{\frac{9}{10}}", r"\frac{10}{9}", 0, {}),
    ("fractions", "math", r"$\frac{1+\sqrt{5}}{2}$", "2", 0, {}),  # main paid
    # --- mixed numbers
    ("mixed numbers", "math", r"\boxed{2\frac{1}{4}}", r"\frac{9}{4}", 1, {}),
    ("mixed numbers", "math", r"\boxed{-2\frac{1}{4}}", "-9/4", 1, {}),
    ("mixed numbers", "math", "The answer is 1 1/2", "3/2", 1, {}),  # main; ours: the reference reads 1
    ("mixed numbers", "math", r"\boxed{\frac{6}{4}}", r"6\frac{1}{4}", 0, {}),
    ("mixed numbers", "math", r"\boxed{\frac{31}{4}}", "7 3/4", 1, {}),  # sweep: prm800k grader; main; ours
    ("mixed numbers", "math", r"\boxed{7.75}", "7 3/4", 1, {}),  # sweep: prm800k grader; main; ours
    ("mixed numbers", "math", r"\boxed{2 1/3}", r"2\frac{1}{3}", 1, {}),  # sweep: prm800k grader; main; ours
    ("mixed numbers", "math", r"\boxed{\frac{30}{4}}", "7 3/4", 0, {}),
    ("mixed numbers", "math", r"\boxed{11 7/6}", r"\frac{83}{6}", 0, {}),
    ("mixed numbers", "math", "The answer is 11 7/6", r"\frac{83}{6}", 0, {}),  # improper: no mixed number
    ("mixed numbers", "math", "11\n5/6", "71/6", 0, {}),  # issue 55: no mixed number across a line break
    ("mixed numbers", "math", "The answer is 3\n1/4", "13/4", 0, {}),  # issue 55
    ("mixed numbers", "math", "The answer is 3 \t1/4", "13/4", 1, {}),  # ours
    ("mixed numbers", "math", "4 4/9 %", "40/9", 0, {}),  # issue 55: the percent applies to the whole number
    ("mixed numbers", "math", "The rate is 4 4/9 %", r"\frac{40}{900}", 1, {}),  # issue 55; ours: the reference reads 4
    ("mixed numbers", "math", "The share is 1 1/2 percent", "3/2", 0, {}),
    ("mixed numbers", "math", "The share is 1 1/2 percent", "0.015", 1, {}),  # ours
    # --- intervals and sets: open and closed ends
    ("intervals", "math", "$[0,1)$", "[0,1)", 1, {}),  # main: read 1
    ("intervals", "math", "$[0,9)$", "(0,9)", 0, {}),  # main paid
    ("intervals", "math", r"The domain is $\boxed{(-\infty, -3] \cup [2, \infty)}$", "[-3,2]", 0, {}),
    ("intervals", "math", r"$\boxed{[-1, -\tfrac12) \cup (-\tfrac12, 0)}$", r"[-1, -\frac{1}{2}) \cup (-\frac{1}{2}, 0)",
     1, {}),
    ("intervals", "math", r"$x \in [-2,7]$", r"$-2 \le x \le 7$", 1, {}),  # main
    ("intervals", "math", r"$(-793, 10)$", r"$-793 < a < 10$", 1, {}),  # main
    ("intervals", "math", r"$-2 \le x \le 7$", r"$x \in [-2,7]$", 1, {}),  # issue 55; ours: the reference refuses
    ("intervals", "math", r"So $\boxed{-1 < t < 3}$", r"(-1, 3)", 1, {}),  # issue 55; ours: the reference refuses
    ("intervals", "math", r"$-2 < x \le 7$", r"$x \in [-2,7]$", 0, {}),
    ("intervals", "math", r"$-2 \le x \le 8$", r"$x \in [-2,7]$", 0, {}),
    ("intervals", "math", r"$-1 < t < 3$", r"[-1, 3]", 0, {}),
    ("intervals", "math", r"\boxed{x \geq 5}", r"[5, \infty)", 1, {}),  # sweep: prm800k grader; main; ours
    ("intervals", "math", r"\boxed{x \le 3}", r"(-\infty, 3]", 1, {}),  # sweep: prm800k grader; main; ours
    ("intervals", "math", r"\boxed{x<-2 \text{ or } x>3}", r"(-\infty,-2)\cup(3,\infty)", 1, {}),  # sweep; main
    ("intervals", "math", r"\boxed{(-\infty,-2)\cup(3,\infty)}", r"x<-2 \text{ or } x>3", 1, {}),  # sweep; main
    ("intervals", "math", r"\boxed{x^2 < 4}", "(-2, 2)", 1, {}),  # sweep; main
    ("intervals", "math", r"\boxed{x > 5}", r"[5, \infty)", 0, {}),
    ("intervals", "math", r"\boxed{x\le-2 \text{ or } x>3}", r"(-\infty,-2)\cup(3,\infty)", 0, {}),
    ("intervals", "math", r"\boxed{x>1 \text{ and } x<3}", "(1, 3)", 0, {}),  # overlapping: no "or" reading
    ("intervals", "math", r"\boxed{x \ge 5}", "5", 0, {}),
    ("intervals", "math", r"\boxed{\varnothing}", r"\emptyset", 1, {}),  # sweep: Qwen2.5-Math parser; main
    ("intervals", "math", r"The set is $\emptyset$.", r"\varnothing", 1, {}),  # sweep: Qwen2.5-Math parser; main
    ("intervals", "math", r"\boxed{\varnothing}", r"\{0\}", 0, {}),
    ("intervals", "math", r"\boxed{\{1,2\}}", r"\{2,1\}", 1, {}),
    ("intervals", "math", r"\boxed{\{1,2\}}", r"\{1,3\}", 0, {}),
    # --- relations and equations
    ("relations", "math", r"Therefore $x \geq 5$ is the solution.", "$x >= 5$", 1, {}),  # main
    ("relations", "math", r"$5 \leq x$", r"x \geq 5", 1, {}),  # main
    ("relations", "math", r"$-x > -1$", "$x < 1$", 1, {}),  # main
    ("relations", "math", r"$x > -1$", "$x < 1$", 0, {}),
    ("relations", "math", r"Therefore $x < 5$ is the solution.", "$x > 5$", 0, {}),
    ("relations", "math", r"$y=-\frac{1}{2}x+\frac{3}{4}$", "$2x+4y-3=0$", 1, {}),  # main
    ("relations", "math", "$x=11$", "11", 1, {}),
    ("relations", "math", "$11a+c$", "$7 = 11a+c$", 0, {}),
    ("relations", "math", "$0$", "$a +3z = 0$", 0, {}),
    # --- matrices
    ("matrices", "math", r"The identity matrix is $ \begin{pmatrix}1 & 0 \\ 0 & 1\end{pmatrix} $.",
     r"$\begin{pmatrix}1 & 0 \\ 0 & 1\end{pmatrix}$", 1, {}),  # main
    ("matrices", "math", r"Special matrix: $ \left[\begin{array}{cc}1 & 2 \\3 & 4\end{array}\right] $",
     r"$\begin{pmatrix}1 & 2 \\3 & 4\end{pmatrix}$", 1, {}),  # main
    ("matrices", "math", r"The matrix is $\begin{pmatrix}1 & 2 \\ 3 & 5\end{pmatrix}$",
     r"$\begin{pmatrix}1 & 2 \\ 3 & 4\end{pmatrix}$", 0, {}),
    # --- tuples and lists
    ("tuples", "math", r"The roots are $\boxed{-2,1}$.", "1,-2", 1, {}),
    ("tuples", "math", "The solutions are $1$, $2$ and $3$.", "1,2,3", 1, {}),  # main: read 3
    ("tuples", "math", "$n=1, 2, 3$", "$n=1, 2, 3$", 1, {}),  # main
    ("tuples", "math", r"so the ordered pair is $(7, 6)$.", "(7,6)", 1, {}),  # main: read 6
    ("tuples", "math", r"\boxed{(3,2)}", "(2,3)", 0, {}),
    ("tuples", "math", r"\boxed{1,2}", "1,2,3", 0, {}),
    # ours (sweep): hendrycks/math's is_equiv refuses a list out of order (math_equivalence_test.py); an answer
    # listed "separated by commas" is a set, as the reference reads it
    ("tuples", "math", r"\boxed{4, 10, -2}", "10, 4, -2", 1, {}),
    # ours (sweep): prm800k's grader refuses an unreduced fraction; the reference pays its value
    ("fractions", "math", r"\boxed{\frac{2}{4}}", r"\frac{1}{2}", 1, {}),
    ("tuples", "math", "$n=2, 3, 4$", "$n=1, 2, 3$", 0, {}),
    # --- multiple choice: a reference that is an option letter is answered by the letter the response marks
    ("choice", "math", "The answer is (C).", "C", 1, {}),  # sweep: Qwen2.5-Math choice_answer_clean; main refused
    ("choice", "math", "**Answer:** C", r"\text{(C)}", 1, {}),  # sweep: Qwen2.5-Math; main refused
    ("choice", "math", r"\boxed{(C) 12}", "C", 1, {}),  # sweep: Qwen2.5-Math; main refused
    ("choice", "math", "C", "(C)", 1, {}),  # sweep: Qwen2.5-Math; main refused
    ("choice", "math", r"\boxed{\text{(C)}}", "C", 1, {}),
    ("choice", "math", "The answer is (B).", "C", 0, {}),
    ("choice", "math", r"Option (C) is 12, so \boxed{12}", "C", 0, {}),  # a letter in passing is no choice
    ("choice", "math", "(C) is wrong. The answer is (B).", r"\text{(C)}", 0, {}),
    # --- LaTeX spellings the grammar misreads
    ("spellings", "math", r"\boxed{\bigl(1, 2\bigr)}", "(1, 2)", 1, {}),  # sweep: math-verify pays it; main refused
    ("spellings", "math", r"\boxed{\Big[0, 1\Big)}", "[0, 1)", 1, {}),  # sweep; main refused
    ("spellings", "math", r"\boxed{45\degree}", r"45^\circ", 1, {}),  # sweep: Qwen2.5-Math parser; main refused
    ("spellings", "math", r"\boxed{12~\text{km}}", "12", 1, {}),  # sweep: lm-eval minerva_math; main refused
    ("spellings", "math", r"\boxed{\sqrt{2}.}", r"\sqrt{2}", 1, {}),  # sweep: Qwen2.5-Math strip_string; main
    ("spellings", "math", r"\boxed{3+2\mathrm{i}}", "5", 0, {}),  # sweep: Qwen2.5-Math (complex); main paid
    ("spellings", "math", r"\boxed{2\mathrm{i}}", "2", 0, {}),  # sweep; main paid: \mathrm{i} dropped as a unit
    ("spellings", "math", r"\boxed{3+2\mathrm{i}}", "3+2i", 1, {}),  # sweep; main refused
    ("spellings", "math", r"\boxed{\mathrm{e}^2}", "e^2", 1, {}),  # sweep: Qwen2.5-Math parser; main refused
    ("spellings", "math", r"\boxed{45^{\degree}}", r"45^\circ", 1, {}),  # sweep; main refused
    ("spellings", "math", r"\boxed{7}", r"7 \pmod{9}", 1, {}),  # sweep: math-verify pays it; main refused
    ("spellings", "math", r"\boxed{7 \pmod{9}}", "7", 1, {}),  # sweep: Qwen2.5-Math parser; main refused
    ("spellings", "math", r"\boxed{7 \pmod{9}}", "9", 0, {}),
    ("spellings", "math", r"\boxed{\bigl(1, 2\bigr]}", "(1, 2)", 0, {}),
    ("spellings", "math", r"\boxed{46\degree}", r"45^\circ", 0, {}),
    ("spellings", "math", r"\boxed{1~000}", "1000", 1, {}),
    # --- units and text
    ("units", "math", r"the area is $\boxed{15\mbox{ cm}^2}$.", "15", 1, {}),
    ("units", "math", r"The distance is $\boxed{125\textnormal{ miles}}.$", "125", 1, {}),
    ("units", "math", r"Hence the angle is $\boxed{90^\circ}$.", "90", 1, {}),
    ("units", "math", r"so her speed is greatest: $\text{Evelyn}$", r"\text{Evelyn}", 1, {}),  # main
    ("units", "math", "$odd$", r"$\text{odd}$", 1, {}),  # main
    ("units", "math", r"the area is $\boxed{16\mbox{ cm}^2}$.", "15", 0, {}),
    ("units", "math", r"$\boxed{\text{Even}}$", r"\text{Odd}", 0, {}),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("cls, source, response, reference, grade, extra_info", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_graded_as_the_reference_grades(cls, source, response, reference, grade, extra_info):
    row = Row(source, [{"role": "user", "content": "?"}], reference, "math", dict(extra_info))
    before = sum(verifier_errors().values())
    assert score(row, response) == grade
    assert sum(verifier_errors().values()) == before  # graded, not failed


def test_every_class_has_right_and_wrong_answers():
    for cls in {c[0] for c in CASES}:
        assert {c[4] for c in CASES if c[0] == cls} == {0, 1}, cls
