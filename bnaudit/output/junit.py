"""`--format junit`: JUnit XML, the test report CI systems show (GitLab
`artifacts:reports:junit`, Jenkins, test-reporter actions).

    <testsuites name="bnaudit inspect" tests failures errors skipped>
      <testsuite name=FILE ...>            one per checked file (a diff: file B)
        <testcase classname=FILE name="(file)">      file-level findings; the error of an
                                                     unreadable file; why a file was skipped
        <testcase classname=FILE name=LAYER>         one per BN layer
          <failure type=CODE message="CODE name: message">severity and message</failure>
          <system-out>findings below fail-on, one line each</system-out>

A finding at or above `fail-on` (the run's exit policy) is a <failure>, one per finding;
a finding below it is a line of <system-out>, so that the report fails exactly the tests
the exit code fails. An unreadable file is an <error>, a skipped or excluded file a
<skipped> test. The counts follow JUnit: `tests` counts test cases, `failures` the test
cases with at least one failure, `errors` those with an error, `skipped` those skipped;
<testsuites> sums its suites.

Untrusted strings are made printable (control characters written as escapes, which XML
1.0 could not carry anyway) and the serializer escapes `& < > "`.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from typing import TYPE_CHECKING

from bnaudit.audit.rules import Finding
from bnaudit.output.checked import CheckedFile, checked_files, fail_on, title
from bnaudit.severity import Severity
from bnaudit.text import printable

if TYPE_CHECKING:
    from bnaudit.output import Report

FILE_CASE = "(file)"  # the test case of file-level findings

# Characters XML 1.0 cannot hold that `printable` leaves (the non-characters U+FFFE, U+FFFF).
_NOT_XML = re.compile("[\ufffe\uffff]")


def xml_text(text: str) -> str:
    """`text` made printable and storable in XML 1.0."""
    return _NOT_XML.sub(lambda m: f"\\u{ord(m.group()):04x}", printable(text))


def to_junit(report: Report) -> str:
    """The JUnit XML document of an inspect, a diff or a fold report."""
    threshold = fail_on(report)
    name = title(report)
    root = ET.Element("testsuites", name=name)
    for file in checked_files(report):
        root.append(_suite(file, threshold))
    for count in ("tests", "failures", "errors", "skipped"):
        root.set(count, str(sum(int(suite.get(count, "0")) for suite in root)))
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def _suite(file: CheckedFile, threshold: Severity) -> ET.Element:
    where = xml_text(file.location)
    suite = ET.Element("testsuite", name=where)
    if file.compared is not None:
        properties = ET.SubElement(suite, "properties")
        ET.SubElement(properties, "property", name="compared-with", value=xml_text(file.compared))
    file_case = ET.SubElement(suite, "testcase", classname=where, name=FILE_CASE)
    if file.error is not None:
        ET.SubElement(file_case, "error", type="unreadable", message=xml_text(file.error))
    elif file.skipped is not None:
        ET.SubElement(file_case, "skipped", message=xml_text(file.skipped))
    by_layer: dict[str | None, list[Finding]] = {}
    for f in file.findings:
        by_layer.setdefault(f.layer, []).append(f)
    _findings(file_case, by_layer.get(None, []), threshold)
    for layer in file.layers:
        case = ET.SubElement(suite, "testcase", classname=where, name=xml_text(layer))
        _findings(case, by_layer.get(layer, []), threshold)
    cases = suite.findall("testcase")
    suite.set("tests", str(len(cases)))
    for count, child in (("failures", "failure"), ("errors", "error"), ("skipped", "skipped")):
        suite.set(count, str(sum(1 for case in cases if case.find(child) is not None)))
    return suite


def _findings(case: ET.Element, findings: list[Finding], threshold: Severity) -> None:
    below = []
    for f in findings:
        severity = Severity.parse(f.severity)
        if severity >= threshold:
            failure = ET.SubElement(case, "failure", type=f.code, message=xml_text(f"{f.code} {f.name}: {f.message}"))
            failure.text = xml_text(f"{severity} {f.code} {f.name}: {f.message}")
        else:
            below.append(xml_text(f"{severity} {f.code} {f.name}: {f.message}"))
    if below:
        ET.SubElement(case, "system-out").text = "\n".join(below)
