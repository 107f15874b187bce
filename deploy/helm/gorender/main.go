// gorender renders deploy/helm/attnd with Go's own text/template, the engine Helm runs, so that
// client/python/tests/test_helm.py can compare it with helm_render.py (a Python reading of the
// same template language) where `go` is installed but `helm` is not. It uses the standard
// library only.
//
// Helm adds Sprig's and its own functions to text/template. The chart uses these, written here
// after their Sprig/Helm definitions: include, default, quote, toYaml, nindent, trunc,
// trimSuffix, fail, int64, kindIs, splitList, replace, b64enc, lookup and randAlphaNum (printf,
// eq, ne, not, and, or and index are text/template's). Like helm_render.py it is strict where
// Helm is lenient: a missing value or file is an error.
//
// Values arrive as JSON (Go has no YAML reader in its standard library): numbers decode as
// float64, as Helm's values do. toYaml writes every string quoted; the test compares parsed
// objects, so only the meaning of the YAML counts.
//
//	gorender -chart DIR -defaults values.json -values over.json [-notes]
//	         [-release attnd] [-namespace default] [-api-versions A,B]
//
// prints each template's output after "---" and "# Source: NAME" lines (as helm template does),
// or NOTES.txt with -notes; a `fail` or any other error goes to stderr with exit status 1.
package main

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"text/template"
)

// chartMeta is what the templates read of Chart.yaml (.Chart.Name, .Chart.Version,
// .Chart.AppVersion).
type chartMeta struct{ Name, Version, AppVersion string }

// files is .Files: Get reads a file of the chart.
type files struct{ root string }

func (f files) Get(name string) (string, error) {
	b, err := os.ReadFile(filepath.Join(f.root, name))
	return string(b), err
}

// versionSet is .Capabilities.APIVersions.
type versionSet []string

func (v versionSet) Has(version string) bool {
	for _, x := range v {
		if x == version {
			return true
		}
	}
	return false
}

// readMeta takes the three top-level scalars the templates use from Chart.yaml.
func readMeta(path string) (chartMeta, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return chartMeta{}, err
	}
	found := map[string]string{}
	re := regexp.MustCompile(`(?m)^(name|version|appVersion):\s*"?([^"#\s]+)"?`)
	for _, m := range re.FindAllStringSubmatch(string(b), -1) {
		found[m[1]] = m[2]
	}
	if len(found) != 3 {
		return chartMeta{}, fmt.Errorf("%s: name, version and appVersion wanted, found %v", path, found)
	}
	return chartMeta{found["name"], found["version"], found["appVersion"]}, nil
}

func readJSON(path string) (map[string]interface{}, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var v map[string]interface{}
	return v, json.Unmarshal(b, &v)
}

// merge lays over on base as Helm does: maps merge key by key, anything else replaces.
func merge(base, over map[string]interface{}) map[string]interface{} {
	out := map[string]interface{}{}
	for k, v := range base {
		out[k] = v
	}
	for k, v := range over {
		b, bok := out[k].(map[string]interface{})
		o, ook := v.(map[string]interface{})
		if bok && ook {
			out[k] = merge(b, o)
		} else {
			out[k] = v
		}
	}
	return out
}

// empty is Sprig's: nil, a zero number, false, and an empty string, list or map.
func empty(v interface{}) bool {
	r := reflect.ValueOf(v)
	if !r.IsValid() {
		return true
	}
	switch r.Kind() {
	case reflect.Array, reflect.Map, reflect.Slice, reflect.String:
		return r.Len() == 0
	case reflect.Bool:
		return !r.Bool()
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return r.Int() == 0
	case reflect.Float32, reflect.Float64:
		return r.Float() == 0
	case reflect.Ptr, reflect.Interface:
		return r.IsNil()
	}
	return false
}

// yamlLines writes v as block YAML, one line per element, every string quoted.
func yamlLines(v interface{}) []string {
	switch x := v.(type) {
	case map[string]interface{}:
		if len(x) == 0 {
			return []string{"{}"}
		}
		keys := make([]string, 0, len(x))
		for k := range x {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		var lines []string
		for _, k := range keys {
			sub := yamlLines(x[k])
			if isBlock(x[k]) {
				lines = append(lines, strconv.Quote(k)+":")
				for _, l := range sub {
					lines = append(lines, "  "+l)
				}
			} else {
				lines = append(lines, strconv.Quote(k)+": "+sub[0])
			}
		}
		return lines
	case []interface{}:
		if len(x) == 0 {
			return []string{"[]"}
		}
		var lines []string
		for _, item := range x {
			sub := yamlLines(item)
			lines = append(lines, "- "+sub[0])
			for _, l := range sub[1:] {
				lines = append(lines, "  "+l)
			}
		}
		return lines
	case string:
		return []string{strconv.Quote(x)}
	case float64:
		return []string{strconv.FormatFloat(x, 'f', -1, 64)}
	case bool:
		return []string{strconv.FormatBool(x)}
	case nil:
		return []string{"null"}
	}
	panic(fmt.Sprintf("toYaml: %T", v))
}

func isBlock(v interface{}) bool {
	switch x := v.(type) {
	case map[string]interface{}:
		return len(x) > 0
	case []interface{}:
		return len(x) > 0
	}
	return false
}

func funcs(tpl **template.Template) template.FuncMap {
	return template.FuncMap{
		"include": func(name string, data interface{}) (string, error) {
			var b strings.Builder
			err := (*tpl).ExecuteTemplate(&b, name, data)
			return b.String(), err
		},
		"default": func(d interface{}, given ...interface{}) interface{} {
			if len(given) == 0 || empty(given[0]) {
				return d
			}
			return given[0]
		},
		"quote": func(v ...interface{}) string {
			var out []string
			for _, x := range v {
				if x != nil {
					out = append(out, fmt.Sprintf("%q", fmt.Sprint(x)))
				}
			}
			return strings.Join(out, " ")
		},
		"toYaml": func(v interface{}) string { return strings.Join(yamlLines(v), "\n") },
		"nindent": func(n int, s string) string {
			pad := strings.Repeat(" ", n)
			return "\n" + pad + strings.ReplaceAll(s, "\n", "\n"+pad)
		},
		"trunc": func(n int, s string) string {
			if n >= 0 && len(s) > n {
				return s[:n]
			}
			return s
		},
		"trimSuffix": func(suffix, s string) string { return strings.TrimSuffix(s, suffix) },
		"fail":       func(msg string) (string, error) { return "", errors.New(msg) },
		"int64": func(v interface{}) (int64, error) {
			switch x := v.(type) {
			case float64:
				return int64(x), nil
			case int:
				return int64(x), nil
			case int64:
				return x, nil
			}
			return 0, fmt.Errorf("int64 of %T %v: only numbers here", v, v)
		},
		"kindIs": func(kind string, v interface{}) bool {
			return reflect.ValueOf(v).Kind().String() == kind
		},
		"splitList": func(sep, s string) []string { return strings.Split(s, sep) },
		"replace":   func(old, new, s string) string { return strings.ReplaceAll(s, old, new) },
		"b64enc":    func(s string) string { return base64.StdEncoding.EncodeToString([]byte(s)) },
		// As `helm template` has it: no cluster, nothing found.
		"lookup": func(api, kind, namespace, name string) map[string]interface{} {
			return map[string]interface{}{}
		},
		// Fixed, as helm_render.py's, so the two renders compare (Helm's is random).
		"randAlphaNum": func(n int) string { return strings.Repeat("r", n) },
	}
}

func run() error {
	chart := flag.String("chart", "", "the chart's directory")
	defaults := flag.String("defaults", "", "values.yaml as JSON")
	values := flag.String("values", "", "the values laid over it, as JSON")
	release := flag.String("release", "attnd", "the release's name")
	namespace := flag.String("namespace", "default", "the release's namespace")
	apiVersions := flag.String("api-versions", "", "what .Capabilities.APIVersions.Has finds, comma-separated")
	notes := flag.Bool("notes", false, "print NOTES.txt instead of the objects")
	flag.Parse()

	meta, err := readMeta(filepath.Join(*chart, "Chart.yaml"))
	if err != nil {
		return err
	}
	base, err := readJSON(*defaults)
	if err != nil {
		return err
	}
	over, err := readJSON(*values)
	if err != nil {
		return err
	}
	var caps versionSet
	if *apiVersions != "" {
		caps = strings.Split(*apiVersions, ",")
	}
	top := map[string]interface{}{
		"Values":       merge(base, over),
		"Release":      map[string]interface{}{"Name": *release, "Namespace": *namespace, "Service": "Helm"},
		"Chart":        meta,
		"Files":        files{*chart},
		"Capabilities": map[string]interface{}{"APIVersions": caps},
	}

	var tpl *template.Template
	tpl = template.New(meta.Name).Funcs(funcs(&tpl)).Option("missingkey=error")
	paths, err := filepath.Glob(filepath.Join(*chart, "templates", "*"))
	if err != nil {
		return err
	}
	sort.Strings(paths)
	var outputs []string
	for _, p := range paths {
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		name := filepath.Base(p)
		if _, err := tpl.New(name).Parse(string(b)); err != nil {
			return err
		}
		isObject := strings.HasSuffix(name, ".yaml") && !strings.HasPrefix(name, "_")
		if (*notes && name == "NOTES.txt") || (!*notes && isObject) {
			outputs = append(outputs, name)
		}
	}
	for _, name := range outputs {
		var b strings.Builder
		if err := tpl.ExecuteTemplate(&b, name, top); err != nil {
			return err
		}
		if *notes {
			fmt.Print(b.String())
		} else {
			fmt.Printf("---\n# Source: %s/templates/%s\n%s\n", meta.Name, name, b.String())
		}
	}
	return nil
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
