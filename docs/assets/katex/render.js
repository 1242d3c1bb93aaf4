// Renders the maths that pymdownx.arithmatex (generic mode) leaves as \( ... \) and \[ ... \],
// with the KaTeX shipped beside this file (0.16.22, MIT licence): the site needs no network.
document$.subscribe(({ body }) => {
  renderMathInElement(body, {
    delimiters: [
      { left: "\\[", right: "\\]", display: true },
      { left: "\\(", right: "\\)", display: false },
    ],
  });
});
