"""verl's code reward and the sandbox-fusion client against dsec's SandboxFusion API.

    dsec serve --sandbox-fusion-listen http://127.0.0.1:8080      # calls run in dsec/code:1
    pip install 'dsec[fusion]'                                    # the sandbox-fusion client, for part 2
    SANDBOX_FUSION_ENDPOINT=http://127.0.0.1:8080 python examples/sandbox_fusion_dsec.py

Part 1 makes the request verl's SandboxFusion tool and code reward make (a POST of JSON to the full
``.../run_code`` URL, with ``memory_limit_MB``) and scores a solution against test cases the way verl
reads the answer: ``status``, then ``compile_result`` and ``run_result``. In verl, point
``sandbox_fusion.url`` (reward) or the tool's ``sandbox_fusion_url`` at ``http://HOST:PORT/run_code``.
Part 2 uses the sandbox-fusion client itself, with files in and out.
"""

from __future__ import annotations

import base64
import os

import requests

ENDPOINT = os.environ.get("SANDBOX_FUSION_ENDPOINT", "http://127.0.0.1:8080").rstrip("/")

TESTS = [("1 2\n", "3"), ("40 2\n", "42"), ("-5 5\n", "0")]
SOLUTIONS = {
    "python": "a, b = map(int, input().split())\nprint(a + b)\n",
    "cpp": "#include <iostream>\nint main() { long a, b; std::cin >> a >> b; std::cout << a + b << std::endl; }\n",
    "java": "import java.util.Scanner;\npublic class Main { public static void main(String[] x) {\n"
    "  Scanner s = new Scanner(System.in); System.out.println(s.nextLong() + s.nextLong()); } }\n",
    "go": 'package main\nimport "fmt"\nfunc main() { var a, b int; fmt.Scan(&a, &b); fmt.Println(a + b) }\n',
}


def verdict(code: str, language: str, stdin: str, expected: str, timeout: int = 10) -> str:
    """One test case as verl's reward scores it: the request it posts, the fields it reads."""
    payload = {
        "code": code,
        "language": language,
        "stdin": stdin,
        "compile_timeout": timeout,
        "run_timeout": timeout,
        "memory_limit_MB": 1024,
        "files": {},
        "fetch_files": [],
    }
    answer = requests.post(f"{ENDPOINT}/run_code", json=payload, timeout=2 * timeout + 10)
    answer.raise_for_status()
    body = answer.json()
    compiled, ran = body.get("compile_result"), body.get("run_result")
    if body["status"] == "SandboxError":
        return f"sandbox error: {body['message']}"
    if compiled and (compiled["status"] != "Finished" or compiled["return_code"] != 0):
        return "compile error"
    if ran["status"] == "TimeLimitExceeded":
        return "timeout"
    if ran["return_code"] != 0:
        return f"runtime error ({ran['return_code']})"
    return "pass" if ran["stdout"].rstrip("\n") == expected else "wrong answer"


def part1() -> None:
    for language, code in SOLUTIONS.items():
        verdicts = [verdict(code, language, stdin, expected) for stdin, expected in TESTS]
        print(f"{language:7} {verdicts}  reward {verdicts.count('pass') / len(TESTS):.2f}")
    print("typo   ", verdict("int main() { return x; }", "cpp", "", ""))
    print("loop   ", verdict("while True: pass", "python", "", "", timeout=1))


def part2() -> None:
    import sandbox_fusion as sf

    data = base64.b64encode(b"3\n1\n2\n").decode()
    code = "nums = sorted(int(x) for x in open('in/numbers.txt'))\nopen('sorted.txt', 'w').write(str(nums))\n"
    request = sf.RunCodeRequest(
        code=code, language="python", files={"in/numbers.txt": data}, fetch_files=["sorted.txt"]
    )
    res = sf.run_code(request, endpoint=ENDPOINT)
    print(
        "client ", res.status.value, base64.b64decode(res.files["sorted.txt"]).decode(), f"in {res.executor_pod_name}"
    )


if __name__ == "__main__":
    part1()
    part2()
