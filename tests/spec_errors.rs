//! Bad specs are refused with one clear line naming the file and the field.

use std::path::{Path, PathBuf};

use kernelforge::codegen::Renderer;
use kernelforge::spec::{expand, DeviceLimits, Dtype, Family, Points};

/// A templates folder with one template that renders, and one that references an unknown variable.
fn templates() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("t")).unwrap();
    std::fs::write(
        dir.path().join("t/ok.cu.tera"),
        "extern \"C\" __global__ void {{ kernel_name }}_main(float* out, const float* inp, int N) {}\n",
    )
    .unwrap();
    std::fs::write(dir.path().join("t/broken.cu.tera"), "{{ no_such_variable }}\n").unwrap();
    dir
}

const GOOD: &str = r#"
[family]
name = "gelu_test"
op = "gelu"
template = "t/ok.cu.tera"
description = "test family"
dtypes = ["f32"]

[params]
block_size = [64, 128, 256]
vector_width = [1, 4]

[derived]
threads = "block_size"

[constraints]
require = ["threads <= max_threads"]

[[kernels]]
name = "main"
grid = ["ceil_div(N, block_size * vector_width)", "1", "1"]
block = ["threads", "1", "1"]

[default]
block_size = 128
vector_width = 4
"#;

fn parse(text: &str, dir: &Path) -> Result<Family, String> {
    Family::parse(text, &PathBuf::from("specs/gelu_test.toml"), dir).map_err(|e| e.to_string())
}

fn error_of(text: &str) -> String {
    let t = templates();
    let e = parse(text, t.path()).expect_err("the spec must be refused");
    assert!(e.starts_with("specs/gelu_test.toml: "), "names the file: {e}");
    assert!(!e.contains('\n'), "one line: {e}");
    e
}

#[test]
fn the_good_spec_loads_and_expands() {
    let t = templates();
    let family = std::sync::Arc::new(parse(GOOD, t.path()).unwrap());
    assert_eq!(family.point_count(&DeviceLimits::default()).unwrap(), 6);
    let all = expand(&family, Points::All, &DeviceLimits::default()).unwrap();
    assert_eq!(all.len(), 6);
    let default = expand(&family, Points::Default, &DeviceLimits::default()).unwrap();
    assert_eq!(default.len(), 1);
    assert_eq!(default[0].params["block_size"], 128);
    assert_eq!(default[0].derived["threads"], 128);
}

#[test]
fn toml_syntax_error_names_the_line() {
    let e = error_of(&GOOD.replace("block_size = [64, 128, 256]", "block_size = [64, 128"));
    assert!(e.contains("line"), "{e}");
}

#[test]
fn unknown_keys_are_refused() {
    let e = error_of(&GOOD.replace("dtypes = [\"f32\"]", "dtypes = [\"f32\"]\ntile = 3"));
    assert!(e.contains("unknown field `tile`"), "{e}");
    let e = error_of(&GOOD.replace("[derived]", "[derivd]"));
    assert!(e.contains("unknown field `derivd`"), "{e}");
}

#[test]
fn empty_value_list() {
    let e = error_of(&GOOD.replace("vector_width = [1, 4]", "vector_width = []"));
    assert!(e.contains("params.vector_width: empty list"), "{e}");
}

#[test]
fn constraint_that_rejects_every_point() {
    let e = error_of(&GOOD.replace("threads <= max_threads", "threads > 4096"));
    assert!(e.contains("constraints.require: no point of the 6-point space"), "{e}");
    assert!(e.contains("`threads > 4096` rejects all of them"), "{e}");
}

#[test]
fn default_outside_the_space() {
    let e = error_of(&GOOD.replace("block_size = 128\n", "block_size = 96\n"));
    assert!(e.contains("default.block_size: 96 is not in params.block_size"), "{e}");
    let e = error_of(&GOOD.replace("vector_width = 4\n", ""));
    assert!(e.contains("default: no value for param `vector_width`"), "{e}");
    let e = error_of(&GOOD.replace("vector_width = 4\n", "vector_width = 4\ntile = 8\n"));
    assert!(e.contains("default.tile: `tile` is not a param"), "{e}");
}

#[test]
fn default_that_violates_a_constraint() {
    let e = error_of(&GOOD.replace("threads <= max_threads", "threads <= 64"));
    assert!(e.contains("default: the default point violates `threads <= 64`"), "{e}");
}

/// `[[start]]` points: each the default with some params changed, checked like the default.
/// `extends`: a spec laid over another of its folder, table by table; and the ways that fails.
#[test]
fn a_spec_extends_another() {
    let t = templates();
    let specs = t.path().join("specs");
    std::fs::create_dir_all(&specs).unwrap();
    std::fs::write(specs.join("gelu_base.toml"), GOOD.replace("gelu_test", "gelu_base")).unwrap();
    let child = |extra: &str| {
        format!(
            "[family]\nextends = \"gelu_base\"\nname = \"gelu_test\"\ndescription = \"child\"\n{extra}\n\
             [params]\nvector_width = [4]\nunroll = [1, 2]\n\n\
             [derived]\nthreads = \"block_size * unroll\"\n\n\
             [constraints]\nrequire = [\"threads <= 256\"]\n\n\
             [default]\nunroll = 2\n"
        )
    };
    let file = specs.join("gelu_test.toml");
    let family = Family::parse(&child(""), &file, t.path()).unwrap();
    assert_eq!(
        (family.name.as_str(), family.description.as_str()),
        ("gelu_test", "child")
    );
    let params: Vec<_> = family.params.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    assert_eq!(
        params,
        [
            ("block_size", vec![64, 128, 256]),
            ("vector_width", vec![4]),
            ("unroll", vec![1, 2])
        ],
        "a param of both takes the child's values in the base's place; new ones go last"
    );
    assert_eq!(family.derived["threads"].to_string(), "block_size * unroll");
    let require: Vec<_> = family.require.iter().map(|e| e.to_string()).collect();
    assert_eq!(
        require,
        ["threads <= max_threads", "threads <= 256"],
        "the base's, then the child's"
    );
    assert_eq!(family.kernels.len(), 1, "inherited");
    let default: Vec<_> = family.default.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    assert_eq!(default, [("block_size", 128), ("vector_width", 4), ("unroll", 2)]);
    // 3 block sizes x 1 width x 2 unrolls, less block_size 256 with unroll 2 (512 threads)
    assert_eq!(family.point_count(&DeviceLimits::default()).unwrap(), 5);

    let error = |text: &str| Family::parse(text, &file, t.path()).unwrap_err().to_string();
    let e = error(&child("").replace("gelu_base", "gelu_nowhere"));
    assert!(e.contains("family.extends") && e.contains("gelu_nowhere.toml"), "{e}");
    let e = error(&child("").replace("extends = \"gelu_base\"", "extends = 3"));
    assert!(e.contains("family.extends") && e.contains("integer"), "{e}");
    std::fs::write(
        specs.join("gelu_middle.toml"),
        child("").replace("gelu_test", "gelu_middle"),
    )
    .unwrap();
    let e = error(&child("").replace("gelu_base", "gelu_middle"));
    assert!(
        e.contains("family.extends") && e.contains("extends another spec itself"),
        "{e}"
    );
    let e = error(&child("colour = \"red\""));
    assert!(e.contains("colour"), "unknown keys are still refused: {e}");
}

#[test]
fn start_points() {
    let t = templates();
    let with = |start: &str| format!("{GOOD}\n[[start]]\n{start}\n");
    let family = parse(&with("block_size = 256\nvector_width = 1"), t.path()).unwrap();
    assert_eq!(family.starts.len(), 1);
    assert_eq!(family.starts[0]["block_size"], 256);
    assert_eq!(family.starts[0]["vector_width"], 1);
    let family = parse(&with("block_size = 64"), t.path()).unwrap();
    assert_eq!(family.starts[0]["vector_width"], 4, "the rest comes from the default");
    let e = error_of(&with("block_size = 96"));
    assert!(
        e.contains("start[0].block_size") && e.contains("96 is not in params.block_size"),
        "{e}"
    );
    let e = error_of(&with("warps = 2"));
    assert!(e.contains("start[0].warps") && e.contains("not a param"), "{e}");
    let e = error_of(&with("block_size = 256").replace(
        "require = [\"threads <= max_threads\"]",
        "require = [\"threads <= max_threads\", \"threads <= 128\"]",
    ));
    assert!(e.contains("start[0]") && e.contains("threads <= 128"), "{e}");
}

#[test]
fn missing_template() {
    let e = error_of(&GOOD.replace("t/ok.cu.tera", "t/nope.cu.tera"));
    assert!(
        e.contains("family.template:") && e.contains("nope.cu.tera does not exist"),
        "{e}"
    );
}

#[test]
fn template_that_fails_to_render() {
    let t = templates();
    let family = std::sync::Arc::new(parse(&GOOD.replace("t/ok.cu.tera", "t/broken.cu.tera"), t.path()).unwrap());
    let variant = expand(&family, Points::Default, &DeviceLimits::default())
        .unwrap()
        .remove(0);
    let e = Renderer::new(t.path())
        .unwrap()
        .render(&variant)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("specs/gelu_test.toml: family.template: templates/t/broken.cu.tera failed to render"),
        "{e}"
    );
    assert!(e.contains("no_such_variable"), "{e}");
}

#[test]
fn template_with_a_syntax_error_names_the_file() {
    let t = templates();
    std::fs::write(t.path().join("t/bad.cu.tera"), "{% if x %} unterminated").unwrap();
    let e = Renderer::new(t.path()).err().expect("refused").to_string();
    assert!(e.contains("bad.cu.tera"), "{e}");
}

#[test]
fn unknown_op_epilogue_and_name_mismatch() {
    let e = error_of(&GOOD.replace("op = \"gelu\"", "op = \"conv\""));
    assert!(e.contains("family.op: unknown op `conv` (known: "), "{e}");
    let e = error_of(&GOOD.replace("dtypes = [\"f32\"]", "dtypes = [\"f32\"]\nepilogues = [\"bias\"]"));
    assert!(e.contains("family.epilogues: op `gelu` has no epilogue `bias`"), "{e}");
    let e = error_of(&GOOD.replace("name = \"gelu_test\"", "name = \"other\""));
    assert!(
        e.contains("family.name: `other` must match the file name `gelu_test.toml`"),
        "{e}"
    );
    let e = error_of(&GOOD.replace("dtypes = [\"f32\"]", "dtypes = [\"f64\"]"));
    assert!(e.contains("f64"), "{e}");
}

#[test]
fn bad_expressions_name_the_field() {
    let e = error_of(&GOOD.replace("threads = \"block_size\"", "threads = \"block_sise * 2\""));
    assert!(
        e.contains("derived.threads: `block_sise * 2`: unknown variable `block_sise` (did you mean `block_size`?)"),
        "{e}"
    );
    let e = error_of(&GOOD.replace("\"threads\", \"1\", \"1\"", "\"threads\", \"1 +\", \"1\""));
    assert!(e.contains("kernels[0].block[1]: cannot parse `1 +`"), "{e}");
    let e = error_of(&GOOD.replace("ceil_div(N, block_size * vector_width)", "ceil_div(M, block_size)"));
    assert!(
        e.contains("kernels[0].grid[0]: `ceil_div(M, block_size)`: unknown variable `M`"),
        "{e}"
    );
    let e = error_of(&GOOD.replace("require = [\"threads <= max_threads\"]", "require = [\"threads = 3\"]"));
    assert!(
        e.contains("constraints.require[0]: cannot parse `threads = 3` at column 9"),
        "{e}"
    );
}

#[test]
fn duplicate_values_and_reserved_names() {
    let e = error_of(&GOOD.replace("vector_width = [1, 4]", "vector_width = [1, 4, 4]"));
    assert!(e.contains("params.vector_width: a value is listed twice"), "{e}");
    let e = error_of(&GOOD.replace("threads = \"block_size\"", "threads = \"block_size\"\nN = \"3\""));
    assert!(e.contains("derived.N:"), "{e}");
}

#[test]
fn prefer_when_is_checked_like_other_shape_expressions() {
    let e = error_of(
        &GOOD
            .replace("rank = 0\n", "")
            .replace("dtypes = [\"f32\"]", "prefer_when = \"M <= 8\"\ndtypes = [\"f32\"]"),
    );
    assert!(e.contains("family.prefer_when: `M <= 8`: unknown variable `M`"), "{e}");
}

#[test]
fn no_kernels() {
    let text =
        GOOD.split("[[kernels]]").next().unwrap().to_string() + "[default]\nblock_size = 128\nvector_width = 4\n";
    let e = error_of(&text);
    assert!(e.contains("kernels: no [[kernels]] entry"), "{e}");
}

/// `[family] arch` names an exact compile target: bad values are refused with the field named,
/// and a family that has one runs only on devices of that compute capability (the others skip
/// it with a reason instead of compiling it for the wrong chip).
#[test]
fn arch_targets() {
    let with_arch = |arch: &str| GOOD.replace("dtypes = [\"f32\"]", &format!("dtypes = [\"f32\"]\narch = \"{arch}\""));
    for bad in ["sm90a", "sm_9", "compute_90a", "sm_90b", "sm_x0a", "sm_1000a", "sm_30"] {
        let e = error_of(&with_arch(bad));
        assert!(e.contains(&format!("family.arch: `{bad}` is not a GPU target")), "{e}");
        assert!(e.contains("sm_90a"), "says what to write: {e}");
    }
    let e = error_of(&GOOD.replace("dtypes = [\"f32\"]", "dtypes = [\"f32\"]\narch = 90"));
    assert!(e.contains("arch"), "{e}");

    let t = templates();
    let hopper = std::sync::Arc::new(parse(&with_arch("sm_90a"), t.path()).unwrap());
    let target = hopper.arch.as_ref().expect("arch parsed");
    assert_eq!((target.name.as_str(), target.compute_capability), ("sm_90a", (9, 0)));
    let blackwell = parse(&with_arch("sm_100a"), t.path()).unwrap();
    assert_eq!(blackwell.arch.unwrap().compute_capability, (10, 0));
    assert!(parse(GOOD, t.path()).unwrap().arch.is_none());

    let variant = expand(&hopper, Points::Default, &DeviceLimits::default())
        .unwrap()
        .remove(0);
    let shape: kernelforge::ops::Shape = [("N".to_string(), 1000)].into_iter().collect();
    let h100 = DeviceLimits::default();
    assert_eq!(h100.compute_capability, (9, 0));
    assert_eq!(variant.check_shape(&shape, &h100), Ok(()));
    let a100 = DeviceLimits {
        compute_capability: (8, 0),
        ..DeviceLimits::default()
    };
    let why = variant.check_shape(&shape, &a100).unwrap_err();
    assert!(why.contains("sm_90a") && why.contains("8.0"), "{why}");
    // The compiler is retargeted to the exact target (so the NVRTC cache key changes with it).
    let compiler = kernelforge::gpu::Compiler {
        arch: "sm_90".into(),
        include_dir: None,
        cache_dir: None,
        nvrtc_version: (13, 0),
    };
    assert_eq!(compiler.for_family(&hopper).arch, "sm_90a");
    assert_eq!(compiler.for_family(&parse(GOOD, t.path()).unwrap()).arch, "sm_90");
}

/// `[family] min_arch`: the oldest GPU per dtype (`all` or a listed dtype), a plain `sm_XY`;
/// a variant of that dtype is refused on older GPUs with the spec named, newer ones run it.
#[test]
fn min_arch_per_dtype() {
    let with = |table: &str| {
        GOOD.replace(
            "dtypes = [\"f32\"]",
            &format!("dtypes = [\"f32\", \"f16\"]\nmin_arch = {table}"),
        )
    };
    let e = error_of(&with(r#"{ bf16 = "sm_80" }"#));
    assert!(e.contains("family.min_arch.bf16") && e.contains("dtypes"), "{e}");
    let e = error_of(&with(r#"{ all = "sm_90a" }"#));
    assert!(e.contains("family.min_arch.all") && e.contains("plain sm_XY"), "{e}");
    let e = error_of(&with(r#"{ f16 = "ampere" }"#));
    assert!(
        e.contains("family.min_arch.f16") && e.contains("not a GPU target"),
        "{e}"
    );

    let t = templates();
    let family = std::sync::Arc::new(parse(&with(r#"{ f16 = "sm_80" }"#), t.path()).unwrap());
    assert_eq!(family.min_compute.get(&Dtype::F16), Some(&(8, 0)));
    assert_eq!(family.min_compute.get(&Dtype::F32), None);
    let shape: kernelforge::ops::Shape = [("N".to_string(), 1000)].into_iter().collect();
    let t4 = DeviceLimits {
        compute_capability: (7, 5),
        ..DeviceLimits::default()
    };
    for v in expand(&family, Points::Default, &t4).unwrap() {
        let on_t4 = v.check_shape(&shape, &t4);
        if v.dtype == Dtype::F16 {
            let why = on_t4.unwrap_err();
            assert!(
                why.contains("8.0") && why.contains("7.5") && why.contains("min_arch"),
                "{why}"
            );
            assert!(
                v.check_shape(&shape, &DeviceLimits::default()).is_ok(),
                "Hopper runs it"
            );
        } else {
            assert_eq!(on_t4, Ok(()), "f32 has no minimum");
        }
    }
    let all = parse(&with(r#"{ all = "sm_80" }"#), t.path()).unwrap();
    assert_eq!(all.min_compute.len(), 2);
}

/// `[[kernels.tensor_maps]]`: the argument must be one of the op's tensors, the swizzle one TMA
/// knows, and the box one TMA accepts; a map whose `when` fails is left out of the launch.
#[test]
fn tensor_maps() {
    let with_map = |map: &str| {
        GOOD.replace(
            "block = [\"threads\", \"1\", \"1\"]\n",
            &format!("block = [\"threads\", \"1\", \"1\"]\n\n[[kernels.tensor_maps]]\n{map}\n"),
        )
    };
    let good = "arg = \"inp\"\nrows = \"1\"\ncols = \"N\"\nbox_rows = \"1\"\nbox_bytes = \"vector_width * 16\"\nswizzle = \"64\"";
    let e = error_of(&with_map(&good.replace("\"inp\"", "\"weight\"")));
    assert!(
        e.contains("kernels[0].tensor_maps[0].arg") && e.contains("`weight` is not a tensor argument of op `gelu`"),
        "{e}"
    );
    let e = error_of(&with_map(&good.replace("\"inp\"", "\"N\"")));
    assert!(e.contains("`N` is not a tensor argument"), "{e}");

    let t = templates();
    let family = std::sync::Arc::new(parse(&with_map(good), t.path()).unwrap());
    let limits = DeviceLimits::default();
    let shape: kernelforge::ops::Shape = [("N".to_string(), 1000)].into_iter().collect();
    let variants = expand(&family, Points::All, &limits).unwrap();
    let launch = |width: i64| {
        let v = variants.iter().find(|v| v.params["vector_width"] == width).unwrap();
        v.launches(&shape, &limits).map_err(|e| e.to_string())
    };
    // 4 x 16 = 64 bytes: 16 floats per box row, within the 64-byte swizzle.
    let maps = launch(4).unwrap().remove(0).tensor_maps;
    assert_eq!(maps.len(), 1);
    assert_eq!((maps[0].arg.as_str(), maps[0].arg_index), ("inp", 1));
    assert_eq!(
        (maps[0].rows, maps[0].cols, maps[0].box_rows, maps[0].box_cols),
        (1, 1000, 1, 16)
    );
    assert_eq!(maps[0].swizzle, 64);
    // 16 bytes is fine too; a swizzle TMA does not have is refused at launch planning.
    assert_eq!(launch(1).unwrap()[0].tensor_maps[0].box_cols, 4);
    let bad = std::sync::Arc::new(parse(&with_map(&good.replace("\"64\"", "\"48\"")), t.path()).unwrap());
    let e = expand(&bad, Points::Default, &limits).unwrap()[0]
        .launches(&shape, &limits)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tensor_maps[0].swizzle") && e.contains("0 (none), 32, 64 or 128"),
        "{e}"
    );
    // A box row wider than the swizzle span.
    let wide = std::sync::Arc::new(parse(&with_map(&good.replace("\"64\"", "\"32\"")), t.path()).unwrap());
    let e = expand(&wide, Points::Default, &limits).unwrap()[0]
        .launches(&shape, &limits)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tensor_maps[0].box_bytes") && e.contains("within the 32-byte swizzle"),
        "{e}"
    );
    // `when`: only some variants take the map.
    let when =
        std::sync::Arc::new(parse(&with_map(&format!("{good}\nwhen = \"vector_width == 4\"")), t.path()).unwrap());
    for v in expand(&when, Points::All, &limits).unwrap() {
        let n = v.launches(&shape, &limits).unwrap()[0].tensor_maps.len();
        assert_eq!(n, (v.params["vector_width"] == 4) as usize, "{}", v.key());
    }
}

/// A `[[kernels]]` entry with `when` runs only for the variants and shapes where it holds: the
/// others' launches leave it out, and each launch names its kernel's place in the spec (the
/// loaded functions are looked up by it). A `when` with an unknown name is refused at load.
#[test]
fn conditional_kernels() {
    let with_first = |when: &str| {
        GOOD.replace(
            "[[kernels]]\nname = \"main\"",
            &format!(
                "[[kernels]]\nname = \"first\"\nwhen = \"{when}\"\ngrid = [\"1\", \"1\", \"1\"]\nblock = [\"32\", \"1\", \"1\"]\n\n[[kernels]]\nname = \"main\""
            ),
        )
    };
    let t = templates();
    let family = std::sync::Arc::new(parse(&with_first("vector_width == 4 && N > 100"), t.path()).unwrap());
    let limits = DeviceLimits::default();
    for n in [64, 1000] {
        let shape: kernelforge::ops::Shape = [("N".to_string(), n)].into_iter().collect();
        for v in expand(&family, Points::All, &limits).unwrap() {
            let launches = v.launches(&shape, &limits).unwrap();
            let names: Vec<(usize, &str)> = launches
                .iter()
                .map(|l| (l.kernel, l.function.rsplit('_').next().unwrap()))
                .collect();
            let first = v.params["vector_width"] == 4 && n > 100;
            let want: &[(usize, &str)] = if first {
                &[(0, "first"), (1, "main")]
            } else {
                &[(1, "main")]
            };
            assert_eq!(names, want, "{} N={n}", v.key());
        }
    }
    let e = error_of(&with_first("no_such_param == 1"));
    assert!(
        e.contains("kernels[0].when") && e.contains("unknown variable `no_such_param`"),
        "{e}"
    );
}

#[test]
fn template_whose_parameters_are_not_the_ops_is_refused_with_both_lists() {
    let t = templates();
    let render = |params: &str| {
        std::fs::write(
            t.path().join("t/ok.cu.tera"),
            format!("extern \"C\" __global__ void __launch_bounds__(128) {{{{ kernel_name }}}}_main({params}) {{}}\n"),
        )
        .unwrap();
        let family = std::sync::Arc::new(parse(GOOD, t.path()).unwrap());
        let variant = expand(&family, Points::Default, &DeviceLimits::default())
            .unwrap()
            .remove(0);
        Renderer::new(t.path())
            .unwrap()
            .render(&variant)
            .map_err(|e| e.to_string())
    };
    render("float* out, const float* __restrict__ inp, int N").expect("the gelu op's own parameters");
    // One missing, as a template of another version of the contract would have it.
    let e = render("float* out, int N").unwrap_err();
    assert!(
        e.starts_with("specs/gelu_test.toml: templates/t/ok.cu.tera declares gelu_test_"),
        "{e}"
    );
    assert!(e.contains("_main(out, N), but the gelu op passes (out, inp, N)"), "{e}");
    assert!(e.contains("--root"), "says where such templates come from: {e}");
    // Extra parameters past the op's are TMA descriptors only.
    let e = render("float* out, const float* inp, int N, int extra").unwrap_err();
    assert!(e.contains("(out, inp, N, extra)"), "{e}");
    render("float* out, const float* inp, int N, const __grid_constant__ TensorMap inp_map").expect("a tensor map");
}
